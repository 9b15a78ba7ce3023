"""The fault-injection table of tools/faults.py (issue 19).

- ``core``: a case (its setup, the exit code and the names its message must hold, a check of what it
  left behind), the shared inputs made once (``Ctx``), running one case, and the verdict;
- ``preprocess_cases``, ``train_cases``, ``tool_cases``: the table, by tool;
- ``report``: the markdown table and the JSON record.
"""
