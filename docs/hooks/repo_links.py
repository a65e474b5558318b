"""MkDocs hook: the site's home page is README.md, and links to files outside docs/ work.

The Markdown files are written to be read on a code host too, so their links are relative to
where the file lives in the repository: README.md links ``docs/errors.md`` and
``examples/demo.py``; ``docs/migration/README.md`` links ``../../examples/...``. MkDocs only
knows the files under ``docs/``. This hook:

* adds README.md as the site's ``index.md`` (one text, two readers);
* copies every repository file that a page links to outside ``docs/`` into the site under
  ``repo/``: a text file as a page that shows it (``repo/examples/demo.py.md``), any other file
  (a notebook) as itself;
* rewrites each link to where its target is in the site.

A link whose target does not exist in the repository is left as written, so that
``mkdocs build --strict`` reports it as a broken link.

It also checks the API reference: every public class and function of a package that has a page
under ``api/`` must be rendered there (mkdocstrings leaves out, without a word, a name that
griffe cannot resolve, e.g. a function that shares its name with a submodule).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
LOG = logging.getLogger("mkdocs.plugins.steplib")
# api/<page>.md documents this module.
API_PAGES = {
    "api/steplib.md": "steplib",
    "api/step.md": "steplib.step",
    "api/handlers.md": "steplib.handlers",
    "api/handlers_logging.md": "steplib.handlers.logging",
    "api/checkpoint.md": "steplib.checkpoint",
    "api/distributed.md": "steplib.distributed",
    "api/data.md": "steplib.data",
    "api/schedules.md": "steplib.schedules",
    "api/seeding.md": "steplib.seeding",
    "api/sweep.md": "steplib.sweep",
    "api/errors.md": "steplib.errors",
    "api/events.md": "steplib.events",
    "api/testing.md": "steplib.testing",
}
ANCHOR = re.compile(r'id="([A-Za-z_][\w.]*)"')
# A Markdown inline link target (no spaces, no title), outside fenced code blocks.
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^\s*(```|~~~)")
TEXT_SUFFIXES = {
    ".py": "python",
    ".toml": "toml",
    ".cfg": "ini",
    ".yml": "yaml",
    ".yaml": "yaml",
    ".txt": "text",
    ".sh": "bash",
    "": "text",
}


def _repo_path(src_uri: str) -> str:
    """Where a page's Markdown lives in the repository."""
    return "README.md" if src_uri == "index.md" else f"docs/{src_uri}"


def _links(markdown: str) -> list[tuple[int, int, str]]:
    """``(start, end, target)`` of every relative link outside fenced code."""
    found, offset, fenced = [], 0, False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            for match in LINK.finditer(line):
                target = match.group(2)
                if not re.match(r"^([a-z][a-z0-9+.-]*:|#|/)", target):
                    found.append((offset + match.start(2), offset + match.end(2), target))
        offset += len(line)
    return found


def _resolve(page_repo_path: str, target: str) -> tuple[str, str]:
    """``(repository path, #anchor)`` of a link written in ``page_repo_path``."""
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), path))
    return resolved, f"#{anchor}" if anchor else ""


def _site_uri(repo_path: str) -> str:
    """The file under the docs that stands for ``repo_path``."""
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    if repo_path == "README.md":
        return "index.md"
    suffix = Path(repo_path).suffix
    return f"repo/{repo_path}.md" if suffix in TEXT_SUFFIXES else f"repo/{repo_path}"


def on_files(files: Files, config: Any) -> Files:
    """Add README.md as index.md, and every repository file a page links to."""
    readme = (ROOT / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=readme))
    wanted: set[str] = set()
    for file in files.documentation_pages():
        markdown = readme if file.src_uri == "index.md" else Path(file.abs_src_path).read_text()
        for _, _, target in _links(markdown):
            repo_path, _ = _resolve(_repo_path(file.src_uri), target)
            if not repo_path.startswith(("docs/", "../")) and repo_path != "README.md":
                wanted.add(repo_path)
    for repo_path in sorted(wanted):
        source = ROOT / repo_path
        if not source.is_file():
            continue  # left to the link check, which names it
        uri = _site_uri(repo_path)
        if uri.endswith(".md") and not repo_path.endswith(".md"):
            language = TEXT_SUFFIXES[source.suffix]
            body = source.read_text()
            content = f"# `{repo_path}`\n\n```{language}\n{body}\n```\n"
            files.append(File.generated(config, uri, content=content))
        else:
            files.append(File.generated(config, uri, abs_src_path=str(source)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite each relative link to where its target lives in the site."""
    src_uri = page.file.src_uri
    if src_uri.startswith("repo/"):
        return markdown
    page_repo_path = _repo_path(src_uri)
    pieces, last = [], 0
    for start, end, target in _links(markdown):
        repo_path, anchor = _resolve(page_repo_path, target)
        if not repo_path.startswith("docs/") and not (ROOT / repo_path).is_file():
            continue  # left as written: the link check names it as the author wrote it
        uri = _site_uri(repo_path)
        new = posixpath.relpath(uri, posixpath.dirname(src_uri) or ".") + anchor
        pieces += [markdown[last:start], new]
        last = end
    pieces.append(markdown[last:])
    return "".join(pieces)


def public_objects(module_name: str) -> dict[str, Any]:
    """The classes and functions a user imports from ``module_name``: its ``__all__``, or the
    public ones defined in it when it has none."""
    if sys.path[0] != str(ROOT):
        sys.path.insert(0, str(ROOT))  # this checkout's steplib, as griffe reads it (paths: [.])
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n for n, o in vars(module).items() if getattr(o, "__module__", None) == module_name
        ]
    objects = {n: getattr(module, n) for n in names if not n.startswith("_")}
    return {n: o for n, o in objects.items() if inspect.isclass(o) or inspect.isfunction(o)}


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """Check that an API page renders every public class and function of its module."""
    module_name = API_PAGES.get(page.file.src_uri)
    if module_name is None:
        return html
    anchors = set(ANCHOR.findall(html))
    for name, obj in public_objects(module_name).items():
        own = f"{obj.__module__}.{obj.__qualname__}"
        if f"{module_name}.{name}" not in anchors and own not in anchors:
            LOG.warning(
                f"{page.file.src_uri}: {module_name}.{name} is not rendered; "
                f"add '::: {own}' to the page"
            )
    return html
