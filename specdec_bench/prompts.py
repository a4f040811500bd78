"""Prompt sets for the decode and serve benchmarks: (use chat template, prompts)."""

PROMPT_SETS: dict[str, tuple[bool, list[str]]] = {
    "code": (False, [
        "def merge_sort(arr):\n    \"\"\"Sort a list with merge sort.\"\"\"\n",
        "class LRUCache:\n    \"\"\"A least-recently-used cache with O(1) get and put.\"\"\"\n\n"
        "    def __init__(self, capacity: int):\n",
        "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and "
        "validate its keys.\"\"\"\n",
    ]),
    "prose": (False, [
        "The history of the printing press begins in",
        "Photosynthesis is the process by which plants",
        "The city council met on Tuesday to discuss",
    ]),
    "chat_code": (True, [
        "Write a Python function that checks whether a string is a palindrome.",
        "Write a function in Python that returns the n-th Fibonacci number iteratively.",
        "Show how to read a CSV file with Python's csv module and sum a column.",
    ]),
}
