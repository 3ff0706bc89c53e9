"""The writeup, rendered from results files: ``writeup/README.md`` (the answers), ``writeup/details/``, the notebook.

:mod:`.load` reads the results; the ``*_section`` modules compute each topic's numbers, tables and
figures and fill its templates (``templates/``, through :mod:`.templating`); :data:`.pages.PAGES`
lists them; :mod:`.render` writes the files.
"""

from cs336_systems.writeup.render import RenderedWriteup, render_writeup

__all__ = ["RenderedWriteup", "render_writeup"]
