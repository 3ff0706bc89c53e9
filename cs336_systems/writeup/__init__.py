"""The writeup, generated from results files: ``writeup/README.md`` and ``writeup/writeup.ipynb``.

Modules, from input to output:

* :mod:`~cs336_systems.writeup.load`: find the machine folders under ``writeup/results`` and read them;
* :mod:`~cs336_systems.writeup.analysis`: numbers derived from records (groupings, fits, predictions);
* :mod:`~cs336_systems.writeup.fmt`: how numbers, tables and settings are written;
* :mod:`~cs336_systems.writeup.figures`: the plots;
* :mod:`~cs336_systems.writeup.coverage`: what was not measured, and the command that measures it;
* ``*_section`` modules: one function per handout problem, listed in
  :data:`~cs336_systems.writeup.pages.PAGES` (the extension point);
* :mod:`~cs336_systems.writeup.render`: the markdown file and the notebook.
"""

from cs336_systems.writeup.render import RenderedWriteup, render_writeup
