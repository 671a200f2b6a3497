"""README.md and docs/*.md name only what exists, and README stays a map.

Checked by reading files only (no Paddle, no plugin import):

* Markdown links and images ``[text](target)``, ``![alt](target)``: a relative target exists
  relative to the folder of the file naming it (``#anchor`` stripped; ``http(s)://`` and
  ``mailto:`` skipped);
* ``#anchor`` of a link to a Markdown file of this repository (or to the same file) names one of
  its headings, slugged as GitHub slugs them;
* inline code that starts like a repository path (``paddle_hybrid/``, ``tests/``, ``examples/``,
  ``benchmarks/``, ``scripts/``, ``docs/``, ``.ci/``, ``custom_ops/``) names an existing file or
  folder; so does such a word in a fenced code block (the commands). A glob must match something,
  ``{a,b}`` expands, and ``<placeholder>`` checks the folder before it;
* inline code (or a word in a fenced block) that starts with a dotted name ``paddle_hybrid.a.b``
  names a module or package under ``paddle_hybrid/`` (``a/b.py``, ``a/b/__init__.py``), or an
  attribute of one: the longest such module prefix is found and the first name after it must be
  bound at the top level of that module (or in ``__all__``); with no module prefix, the first
  name must be bound in ``paddle_hybrid/__init__.py``;
* README.md is at most 20,500 bytes: the how-it-works lives in docs/.

Each test lists every missing target at once, with the file and line that named it.

    python -m pytest tests/test_doc_links.py -q --noconftest
    python tests/test_doc_links.py
"""
from __future__ import annotations

import ast
import collections
import functools
import glob
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 20_500

PATH_PREFIXES = ("paddle_hybrid/", "tests/", "examples/", "benchmarks/", "scripts/", "docs/", ".ci/",
                 "custom_ops/")
DOTTED_PREFIX = "paddle_hybrid."
# A word of a fenced block that starts with "paddle_hybrid/" is a line of a layout picture, not a
# path; fenced blocks are checked for the other prefixes and for dotted names.
FENCED_PATH_PREFIXES = tuple(p for p in PATH_PREFIXES if p != "paddle_hybrid/")

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+(?:\([^()\s]*\))?)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_DOTTED = re.compile(r"paddle_hybrid(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_TRAILING = ".,;:!?)'\"]"


def doc_files() -> list[pathlib.Path]:
    return [README] + sorted((ROOT / "docs").glob("*.md"))


def rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


@functools.lru_cache(maxsize=None)
def split_markdown(path: pathlib.Path):
    """(prose, fenced): ``prose`` is the text with fenced blocks blanked (line numbers kept);
    ``fenced`` lists (line number, text) of every line inside a fenced block."""
    prose_lines, fenced = [], []
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            prose_lines.append("")
        elif fence is not None:
            if m and m.group(1) == fence and line.strip() == fence:
                fence = None
            else:
                fenced.append((number, line))
            prose_lines.append("")
        else:
            prose_lines.append(line)
    return "\n".join(prose_lines), tuple(fenced)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def code_spans(path: pathlib.Path):
    """(line, content) of every inline code span outside fenced blocks."""
    prose, _ = split_markdown(path)
    for m in _CODE_SPAN.finditer(prose):
        yield line_of(prose, m.start()), " ".join(m.group(2).split())


def prose_without_code(path: pathlib.Path) -> str:
    prose, _ = split_markdown(path)
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)


def links(path: pathlib.Path):
    """(line, target) of every Markdown link, image and reference definition outside code."""
    text = prose_without_code(path)
    for m in _LINK.finditer(text):
        yield line_of(text, m.start()), m.group(1)
    for m in _REF_DEF.finditer(text):
        yield line_of(text, m.start()), m.group(1)


def is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None  # http:, https:, mailto:, ...


# --- headings and anchors -------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline markup dropped, lower case, punctuation other than
    '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: pathlib.Path) -> frozenset:
    prose, _ = split_markdown(path)
    seen = collections.Counter()
    out = set()
    for line in prose.splitlines():
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return frozenset(out)


# --- repository paths -----------------------------------------------------------------------

def _expand_braces(token: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    out = []
    for alt in m.group(1).split(","):
        out.extend(_expand_braces(token[:m.start()] + alt + token[m.end():]))
    return out


def clean_token(word: str) -> str:
    word = word.strip("'\"")
    while word and word[-1] in _TRAILING:
        if word[-1] == ")" and word.count("(") >= word.count(")"):
            break
        word = word[:-1]
    return word


def path_exists(token: str) -> bool:
    """Does the repository path ``token`` (possibly with a glob, braces or a placeholder) exist?"""
    for candidate in _expand_braces(token):
        if "<" in candidate:  # `tests/static/<feature>`: the folder before the placeholder
            candidate = candidate[:candidate.index("<")].rsplit("/", 1)[0] or "."
        if any(ch in candidate for ch in "*?["):
            if not glob.glob(str(ROOT / candidate), recursive=True):
                return False
        elif not _exists(ROOT / candidate):
            return False
    return True


def _exists(path: pathlib.Path) -> bool:
    """A file, or a folder holding more than byte-code caches (a package moved away leaves its
    ``__pycache__`` behind in a working tree)."""
    if path.is_dir():
        return any(child.name != "__pycache__" for child in path.iterdir())
    return path.exists()


def repository_paths(path: pathlib.Path):
    """(line, path token) of every path into the repository named in inline code, and of every
    word of a fenced block that starts like one (commands)."""
    for number, content in code_spans(path):
        for word in content.split():
            word = clean_token(word)
            if word.startswith(PATH_PREFIXES):
                yield number, word
    _, fenced = split_markdown(path)
    for number, line in fenced:
        for word in line.split():
            word = clean_token(word)
            if word.startswith(FENCED_PATH_PREFIXES) and re.fullmatch(r"[\w./{},*<>@+-]+", word):
                yield number, word


# --- dotted names ---------------------------------------------------------------------------

def _module_file(parts: list[str]) -> pathlib.Path | None:
    base = ROOT.joinpath("paddle_hybrid", *parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if parts and base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


@functools.lru_cache(maxsize=None)
def top_level_names(module: pathlib.Path) -> frozenset | None:
    """Names bound at the top level of ``module`` (None: anything may be, e.g. a module
    ``__getattr__`` or a star import)."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    names = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
                if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                         for t in node.targets)
                        and isinstance(node.value, (ast.List, ast.Tuple))):
                    names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
            elif isinstance(node, ast.Import):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name == "*":
                        raise _Permissive
                    names.add(a.asname or a.name)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    try:
        visit(tree.body)
    except _Permissive:
        return None
    if "__getattr__" in names:
        return None
    return frozenset(names)


class _Permissive(Exception):
    pass


def dotted_problem(name: str) -> str | None:
    """Why ``paddle_hybrid.a.b...`` names nothing, or None when it resolves."""
    parts = name.split(".")[1:]
    for k in range(len(parts), -1, -1):
        module = _module_file(parts[:k])
        if module is None:
            continue
        rest = parts[k:]
        if not rest:
            return None
        bound = top_level_names(module)
        if bound is None or rest[0] in bound:
            return None
        if k == 0:
            return (f"no module paddle_hybrid/{'/'.join(parts[:1])}(.py), and paddle_hybrid/__init__.py "
                    f"binds no {rest[0]!r}")
        return f"{rel(module)} binds no {rest[0]!r}"
    return "paddle_hybrid/__init__.py is missing"


def dotted_names(path: pathlib.Path):
    """(line, name) of every dotted ``paddle_hybrid.`` name opening inline code or a word of a
    fenced block."""
    for number, content in code_spans(path):
        for word in content.split():
            word = word.strip("'\"(")
            if word.startswith(DOTTED_PREFIX):
                m = _DOTTED.match(word)
                if m:
                    yield number, m.group(0)
    _, fenced = split_markdown(path)
    for number, line in fenced:
        for word in line.split():
            word = word.strip("'\"(")
            if word.startswith(DOTTED_PREFIX):
                m = _DOTTED.match(word)
                if m:
                    yield number, m.group(0)


# --- report ---------------------------------------------------------------------------------

def report(title: str, missing: dict) -> str:
    """One line per missing target, every place that named it."""
    lines = [f"{title}: {len(missing)} target(s), each with where it is named:"]
    for target in sorted(missing):
        places = ", ".join(missing[target])
        lines.append(f"  {target}    <- {places}")
    return "\n".join(lines)


def collect_missing_links() -> dict:
    missing = collections.defaultdict(list)
    for doc in doc_files():
        for number, target in links(doc):
            if is_external(target):
                continue
            file_part = target.split("#", 1)[0]
            if not file_part:
                continue
            if not _exists(doc.parent / file_part):
                missing[f"{file_part} (from {rel(doc.parent) if doc.parent != ROOT else '.'}/)"].append(
                    f"{rel(doc)}:{number}")
    return missing


def collect_missing_anchors() -> dict:
    missing = collections.defaultdict(list)
    for doc in doc_files():
        for number, target in links(doc):
            if is_external(target) or "#" not in target:
                continue
            file_part, anchor = target.split("#", 1)
            dest = (doc.parent / file_part) if file_part else doc
            if dest.suffix != ".md" or not dest.is_file():
                continue  # a missing file is reported by test_links_resolve
            if anchor not in anchors(dest.resolve()):
                missing[f"{rel(dest.resolve())}#{anchor}"].append(f"{rel(doc)}:{number}")
    return missing


def collect_missing_paths() -> dict:
    missing = collections.defaultdict(list)
    for doc in doc_files():
        for number, token in repository_paths(doc):
            if not path_exists(token):
                missing[token].append(f"{rel(doc)}:{number}")
    return missing


def collect_unresolved_names() -> dict:
    missing = collections.defaultdict(list)
    for doc in doc_files():
        for number, name in dotted_names(doc):
            why = dotted_problem(name)
            if why:
                missing[f"{name} ({why})"].append(f"{rel(doc)}:{number}")
    return missing


# --- tests ----------------------------------------------------------------------------------

def test_links_resolve():
    missing = collect_missing_links()
    assert not missing, report("Markdown links to files that do not exist", missing)


def test_link_anchors_name_headings():
    missing = collect_missing_anchors()
    assert not missing, report("links to a #heading that the file does not have", missing)


def test_repository_paths_exist():
    missing = collect_missing_paths()
    assert not missing, report("repository paths named in code that do not exist", missing)


def test_dotted_names_resolve():
    missing = collect_unresolved_names()
    assert not missing, report("paddle_hybrid.* names that resolve to no module or attribute", missing)


def test_readme_is_a_map():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, more than {README_MAX_BYTES}: move how-it-works text and figures "
        "into docs/ and link to them")


if __name__ == "__main__":
    import sys

    failed = 0
    for test in (test_links_resolve, test_link_anchors_name_headings, test_repository_paths_exist,
                 test_dotted_names_resolve, test_readme_is_a_map):
        try:
            test()
            print(f"ok      {test.__name__}")
        except AssertionError as error:
            failed += 1
            print(f"FAILED  {test.__name__}\n{error}\n")
    sys.exit(1 if failed else 0)
