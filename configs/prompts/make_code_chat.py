"""Write configs/prompts/code-chat.jsonl: coding requests and tool-use conversations about stdlib functions.

Usage: python configs/prompts/make_code_chat.py configs/prompts/code-chat.jsonl (deterministic: same file each run)
"""
import json
import sys

from draftsmith.data.prompts import public_functions

MODULES = ["bisect", "collections", "csv", "datetime", "difflib", "functools", "heapq", "itertools", "json",
           "math", "os.path", "pathlib", "re", "shlex", "statistics", "string", "textwrap", "urllib.parse"]
TEMPLATES = [
    "Complete this Python function so that it uses `{qual}`:\n\n```python\ndef solve(data):\n    \"\"\"{doc}\"\"\"\n```",
    "Refactor the following loop to use `{qual}{sig}` and explain the change:\n\n```python\nresult = []\nfor item in items:\n    result.append(item)\n```",
    "Write pytest tests for a helper that wraps `{qual}`. The documentation says: \"{doc}\"",
    "What does `{qual}{sig}` return for an empty input, and how should calling code handle that?",
]
TOOLS = [
    {"type": "function", "function": {"name": "run_python", "description": "Run a Python snippet and return its stdout.",
     "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                    "required": ["code"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a text file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]
SYSTEM = "You are a coding assistant. Use the tools to check your answers before you reply."

def functions(name):
    for qual, sig, doc in public_functions(name, max_signature_chars=80):
        yield qual, sig, doc.replace('"', "'")

records = []
for m in MODULES:
    funcs = list(functions(m))[:6]
    for j, (qual, sig, doc) in enumerate(funcs):
        t = TEMPLATES[(j + len(records)) % len(TEMPLATES)]
        records.append({"messages": [{"role": "user", "content": t.format(qual=qual, sig=sig, doc=doc)}]})
    for qual, sig, doc in funcs[:2]:
        code = f"import {m.split('.')[0]}\nhelp({qual})"
        records.append({"tools": TOOLS, "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Check what `{qual}` does on this machine and then show me one example."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "run_python", "arguments": {"code": code}}}]},
            {"role": "tool", "content": f"Help on function {qual.split('.')[-1]}:\n\n{qual.split('.')[-1]}{sig}\n    {doc}"},
        ]})
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
print(len(records), "conversations,", sum("tools" in r for r in records), "with tool calls")
