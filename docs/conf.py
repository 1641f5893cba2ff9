"""Sphinx configuration of the deltackpt documentation: the manual (Markdown pages, read by
MyST) and the API reference, generated from the docstrings by autodoc. ``.ci/run`` builds it
with warnings as errors: ``sphinx-build -W --keep-going docs docs/_build``."""

from deltackpt import __version__

project = "deltackpt"
release = version = __version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_title = f"deltackpt {release}"
