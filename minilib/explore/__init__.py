"""Teaching aids: the course's figures, its interactive explorers, and the catalogue of
validation mistakes the playground runs. The learner uses them; the course does not ask them
to write them.

One module per idea of the course, each with its figure (matplotlib, no pyplot) and its
explorer (ipywidgets 7 and 8):

  head_grouping.py    which q heads share each KV head (MHA, GQA, MQA)
  page_table.py       the paged KV cache: page pool, page table, wasted slots
  ragged_batch.py     a ragged batch: packed q rows, each sequence's causal mask
  kernel_schedule.py  the Pallas kernel's grid, KV blocks and double buffer
  levers.py           the speed levers, one checkbox each: bundles per KV block, compiled
  playground.py       the validation playground
  mistakes.py         the common input mistakes, shared by the playground, notebook 05 and
                      the tests

and what they share:

  style.py            the palette, figures without pyplot, boxes and labels that fit
  text.py             counts and lists in words (`plural`), and the explorers' HTML
  explorer.py         `Explorer`, its controls, and reading typed input
"""

__all__: list[str] = []  # import from the modules: `from minilib.explore.page_table import ...`
