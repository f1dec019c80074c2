"""Flower's settings for phorge-bridge, read as Python by ``celery -A bridge flower
--conf=compose/flowerconfig.py`` (compose mounts it); a command-line option wins.

Search a Phorge task by its id and class, ``kwargs:12=PhabricatorTestWorker``: that finds
every message that carried task 12 (its runs, the batch that sent it on, a yield and its
later run), and not those of #120 or #112. A message's id finds it too.
"""

# A row names its Phorge tasks (args: their labels, ``('PhabricatorTestWorker#12',)``;
# kwargs: the pairs the search matches, ``{12: 'PhabricatorTestWorker'}``), how the
# message ended (result; a batch's names each task's outcome), and why it failed.
tasks_columns = "name,uuid,state,args,kwargs,result,exception,received,runtime,worker"

# Polls never show (bridge/runtime/quiet_polls.py): every task kept is a message that
# carried Phorge tasks. Flower keeps them in memory and scans them all on each search:
# 50,000 take about 180 MB and a search about 0.3 s (Flower 2.2; its default, 100,000,
# twice that). The database keeps the whole history: `phorge-bridge list`.
max_tasks = 50000
