"""Building blocks of CS336 assignment 1, rebuilt here: the layers and the Transformer LM.

``cs336_basics.model`` holds ``Linear``, ``Embedding``, ``RMSNorm`` and the LM made of them;
the public assignment-2 tests import these names from here. Nothing in this package knows of
``torch.distributed``.
"""
