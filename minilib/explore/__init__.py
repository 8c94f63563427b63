"""Teaching aids: the course's figures, its interactive explorers, and the catalogue of
validation mistakes the playground runs. The learner uses them; the course does not ask them
to write them.

  figures.py    one figure per idea (matplotlib, no pyplot)
  widgets.py    the ipywidgets explorers (ipywidgets 7 and 8)
  mistakes.py   the common input mistakes, shared by the playground, notebook 05 and the tests
"""

__all__: list[str] = []  # import from the modules: `from minilib.explore.widgets import ...`
