"""Training prompts from real sources: GSM8K train questions and code requests written from installed Python code.

The templated and Magpie prompts of :mod:`.prompts` are narrow (a 135M target writing its own requests repeats
itself), and a drafter trained on them generalises poorly to text it never saw. These sources are diverse by
construction:

* :func:`gsm8k_prompts` — the 7,473 human-written GSM8K *train* questions (``../shared/train_data``), with the
  evaluation suffix, and their human solutions as off-policy text (:func:`gsm8k_solution_records`);
* :func:`code_prompts` — requests built from the public functions and classes of real modules (standard
  library and installed packages): implement-from-docstring (HumanEval shape), one-line tasks (MBPP shape),
  explain-this-code, find-the-bug and write-tests requests. Which modules feed training and which are held out
  is the caller's choice (``HELD_OUT_CODE_MODULES`` are never used for training by the recipe, and
  ``CALIBRATION_CODE_MODULES`` only for calibration prompts).

Every source is deterministic for a seed, so a resumable regeneration sees the same prompt list on every run.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import textwrap
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

from .prompts import CODE_PREFIX, MATH_SUFFIX, EvalOverlapGuard, Prompt, dedupe

#: Standard-library modules whose functions become training code prompts.
TRAIN_CODE_MODULES = (
    "string", "textwrap", "json", "csv", "itertools", "functools", "operator",
    "collections", "math", "cmath", "random", "shutil", "os.path", "posixpath", "pathlib", "fnmatch", "glob",
    "base64", "binascii", "hashlib", "hmac", "secrets", "uuid", "datetime", "time", "zlib", "gzip",
    "tarfile", "zipfile", "configparser", "argparse", "logging", "urllib.parse", "html", "html.parser",
    "xml.dom.minidom", "email.utils", "mimetypes", "copy", "pprint", "reprlib", "enum",
    "contextlib", "abc", "typing", "dataclasses", "inspect", "ast", "tokenize", "keyword", "re",
    "unicodedata", "locale", "gettext", "codecs", "io", "tempfile", "filecmp", "sched", "queue", "threading",
    "subprocess", "socket", "selectors", "asyncio", "concurrent.futures", "doctest", "unittest", "timeit",
    "traceback", "warnings", "weakref", "types", "array", "struct", "decimal", "numbers", "quopri",
    "wave", "sqlite3", "pickle", "shelve", "plistlib", "netrc", "smtplib", "http.cookies", "wsgiref.util",
)
#: Modules kept out of training: the held-out code prompts are written from these (see data/heldout/README.md).
HELD_OUT_CODE_MODULES = ("statistics", "fractions", "difflib", "heapq", "bisect", "calendar", "ipaddress", "shlex",
                         "graphlib", "colorsys", "zoneinfo", "tomllib", "stringprep")

#: Modules neither training nor the held-out set uses: a drafter's calibration prompts are written from these, so a
#: fit never scores rounds the drafter trained on however far the regeneration reaches (``scripts/unseen_prompts.py``).
CALIBRATION_CODE_MODULES = (
    "optparse", "pstats", "dis", "pickletools", "linecache", "fileinput", "bz2", "lzma", "pkgutil", "sysconfig",
    "platform", "xml.etree.ElementTree", "xml.sax.saxutils", "urllib.request", "http.server", "socketserver",
    "xmlrpc.client", "ftplib", "imaplib", "mailbox", "tracemalloc", "codeop", "pyclbr", "importlib.metadata",
    "webbrowser", "bdb", "ssl", "signal", "getpass", "cProfile", "profile",
)

_MBPP_STYLES = ("Write a python function to {task}.", "Write a function to {task}.",
                "Write a Python function that {task_s}.", "Implement {name} in Python: {task_s}.")
_VERBS = ("return", "create", "compute", "convert", "check", "make", "get", "set", "find", "build", "parse",
          "read", "write", "split", "join", "remove", "add", "encode", "decode", "format", "test", "copy", "open")
_CODE_STYLES = ("implement", "task", "explain", "bug", "tests", "docstring", "refactor", "complexity")


def gsm8k_prompts(path: str | Path, guard: EvalOverlapGuard | None = None) -> list[Prompt]:
    """GSM8K train questions with the evaluation's reasoning suffix (the target answers them itself)."""
    prompts = []
    for record in _read_jsonl(path):
        text = record["turns"][0].strip() + MATH_SUFFIX
        if guard is None or not guard.overlaps(text):
            prompts.append(Prompt((text,), "gsm8k"))
    return prompts


def gsm8k_solution_records(path: str | Path, guard: EvalOverlapGuard | None = None) -> list[dict]:
    """Human-written GSM8K solutions as chat records (off-policy text for a prefill-only target pass).

    The ``<<48/2=24>>`` calculator annotations are removed and the ``#### 72`` answer line becomes the
    evaluation's ``\\boxed{72}``, so the text reads like an answer to the suffixed prompt."""
    records = []
    for record in _read_jsonl(path):
        question = record["turns"][0].strip() + MATH_SUFFIX
        if guard is not None and guard.overlaps(question):
            continue
        answer = re.sub(r"<<[^>]*>>", "", record["reference_answer"])
        answer = re.sub(r"\n?#### *(.+)\s*$", lambda m: f"\nThe final answer is \\boxed{{{m.group(1).strip()}}}.",
                        answer)
        records.append({"category": "gsm8k-human",
                        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return records


def _read_jsonl(path: str | Path) -> Iterable[dict]:
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


# ---------------------------------------------------------------------------------------------------------
# Code prompts from real modules
# ---------------------------------------------------------------------------------------------------------
class CodeObject:
    """A public function or class of a module: its name, signature, docstring and (when readable) source."""

    def __init__(self, qualname: str, signature: str, doc: str, source: str | None, is_function: bool = True):
        self.qualname, self.signature, self.doc, self.source = qualname, signature, doc, source
        self.is_function = is_function

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def summary(self) -> str:
        """The docstring's first sentence, lower-cased at the start, without a trailing period."""
        first = re.split(r"(?<=[.!?])\s|\n\n", self.doc.strip(), maxsplit=1)[0].strip().rstrip(".")
        return first[:1].lower() + first[1:] if first else ""


def iter_code_objects(module_names: Sequence[str], max_source_lines: int = 40) -> list[CodeObject]:
    """Public functions and classes (with a docstring) of the modules that import; sorted, deterministic."""
    found = []
    for module_name in module_names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except Exception:  # a module missing on this machine is simply not a source
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) not in (module.__name__, module_name):
                continue  # re-exported from elsewhere
            doc = inspect.getdoc(obj) or ""
            if len(doc.split()) < 4 or doc.startswith(f"{name}("):
                continue  # undocumented, or a bare signature (ast node classes)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue
            try:
                signature = f"{name}{inspect.signature(obj)}"
            except (TypeError, ValueError):
                signature = f"{name}(...)"
            try:
                source = textwrap.dedent(inspect.getsource(obj))
                if source.count("\n") > max_source_lines:
                    source = None
            except (OSError, TypeError):
                source = None
            found.append(CodeObject(f"{module_name}.{name}", signature, doc, source, inspect.isfunction(obj)))
    return found


def _third_person(task: str) -> str:
    def conjugate(m: re.Match) -> str:
        verb = m.group(1)
        if verb.endswith("s") and not verb.endswith("ss"):
            return verb  # already third person ("returns", "represents")
        return verb + ("es" if verb.endswith(("sh", "ch", "x", "ss")) else "s")

    return re.sub(r"^(\w+)", conjugate, task, count=1)


def _imperative(task: str) -> str:
    """"returns the sum" -> "return the sum" (docstrings are often written in the third person)."""
    def base_form(m: re.Match) -> str:
        verb = m.group(1)
        if verb.endswith("ies"):
            return verb[:-3] + "y"
        if verb.endswith(("sses", "shes", "ches", "xes")):
            return verb[:-2]
        if verb.endswith("s") and not verb.endswith("ss"):
            return verb[:-1]
        return verb

    return re.sub(r"^(\w+)", base_form, task, count=1)


def _introduce_bug(source: str, rng: random.Random) -> str | None:
    """A plausible one-token bug (comparison, off-by-one, wrong boolean), or None when nothing fits."""
    mutations = [(r" < ", " <= "), (r" <= ", " < "), (r" > ", " >= "), (r" == ", " != "), (r" and ", " or "),
                 (r"\+ 1\b", "- 1"), (r"- 1\b", "+ 1"), (r"\breturn True\b", "return False")]
    rng.shuffle(mutations)
    body = source.split('"""')[-1] if source.count('"""') >= 2 else source  # never mutate the docstring
    for pattern, replacement in mutations:
        matches = list(re.finditer(pattern, body))
        if matches:
            m = rng.choice(matches)
            offset = len(source) - len(body)
            return source[:offset + m.start()] + re.sub(pattern, replacement, m.group(0)) + source[offset + m.end():]
    return None


def _code_prompt(obj: CodeObject, style: str, rng: random.Random) -> str | None:
    summary = obj.summary
    doc = textwrap.indent(textwrap.shorten(obj.doc, 600, placeholder=" ..."), "    ")
    if style == "implement" and obj.is_function:
        return f'{CODE_PREFIX}```python\ndef {obj.signature}:\n    """\n{doc}\n    """\n```'
    if style == "implement":
        return f'Implement the Python class `{obj.name}`:\n```python\nclass {obj.name}:\n    """\n{doc}\n    """\n```'
    if style == "task" and re.match(r"^(\w+[^s]s|" + "|".join(_VERBS) + r")\b", summary):
        task = _imperative(summary)
        return rng.choice(_MBPP_STYLES).format(task=task, task_s=_third_person(task), name=f"`{obj.name}`")
    if style == "docstring" and obj.source:
        stripped = re.sub(r'(""".*?"""|\'\'\'.*?\'\'\')\n?', "", obj.source, count=1, flags=re.S)
        return f"Write a clear docstring for this Python code:\n```python\n{stripped.rstrip()}\n```"
    if style == "explain" and obj.source:
        return f"Explain what this Python code does, step by step:\n```python\n{obj.source.rstrip()}\n```"
    if style == "bug" and obj.source:
        buggy = _introduce_bug(obj.source, rng)
        if buggy is not None:
            return f"This Python function has a bug. Find it and give the corrected code.\n```python\n{buggy.rstrip()}\n```"
    if style == "tests" and summary:
        return f"Write pytest unit tests for `{obj.signature}`, which should {summary}."
    if style == "refactor" and obj.source:
        return f"Rewrite this Python code to be more readable, keeping its behaviour:\n```python\n{obj.source.rstrip()}\n```"
    if style == "complexity" and obj.source:
        return f"What is the time complexity of this function? Explain.\n```python\n{obj.source.rstrip()}\n```"
    return None


def code_prompts(module_names: Sequence[str], seed: int = 0, per_object: int = 2,
                 guard: EvalOverlapGuard | None = None) -> list[Prompt]:
    """Up to ``per_object`` prompts of different styles for each public function / class of the modules."""
    rng = random.Random(seed)
    prompts = []
    for obj in iter_code_objects(module_names):
        styles = list(_CODE_STYLES)
        rng.shuffle(styles)
        made = 0
        for style in styles:
            text = _code_prompt(obj, style, rng)
            if text is None or (guard is not None and guard.overlaps(text)):
                continue
            prompts.append(Prompt((text,), f"code-{style}"))
            made += 1
            if made >= per_object:
                break
    rng.shuffle(prompts)
    return dedupe(prompts)


__all__ = ["CALIBRATION_CODE_MODULES", "HELD_OUT_CODE_MODULES", "TRAIN_CODE_MODULES", "CodeObject", "code_prompts",
           "gsm8k_prompts", "gsm8k_solution_records", "iter_code_objects"]
