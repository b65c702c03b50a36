"""The README and the docs site (docs/, mkdocs.yml) cannot drift from the code.

The site builds with ``mkdocs build --strict`` (a broken link, anchor or nav entry fails; a negative control
shows a broken link does), the README stays short and its links resolve, the metrics reference and the
speculative-config table name everything the code has. And every fenced ``bash`` / ``sh`` / ``console`` /
``python`` block of the README and of every page carries a marker in the HTML comment just above it, and the
test does what the marker says:

* ``run``: executed. Python clients and ``specdec bench`` run against a tiny served stack this test starts
  (``localhost:8000`` / ``localhost:50050`` are rewritten to its ports; ``SPECDEC_BENCH_BASE_URL`` points
  ``specdec bench`` at it); other shell blocks run in an empty folder. ``run slow`` blocks load real
  models (``-m slow``).
* ``parse``: not runnable here (installs, long-running servers, a cluster): every command must be one the
  test knows, and each ``specdec ...`` command line is parsed by the CLI's own parser, the scripts exist
  and pass ``bash -n``, ``helm install --set`` keys exist in the chart's values.
* ``fragment``: a Python excerpt, compiled.

A block without a marker, or a command the test does not know, fails: the docs cannot drift from the CLI.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.requirements import missing, require_package

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
LANGS = {"bash", "sh", "console", "python"}
MARKER = re.compile(r"<!--\s*doc-test:\s*(run|parse|fragment)(\s+slow)?\b(.*?)-->")
SERVED_AS = "smollm2-135m"  # the model name the snippets' clients send


@dataclass
class Block:
    page: str  # the file, relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str
    kind: str
    slow: bool
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}-{self.lang}-{self.kind}"


def blocks(path: Path) -> list[Block]:
    found, lines, page = [], path.read_text().splitlines(), str(path.relative_to(ROOT))
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        lang = fence.group(1)
        if lang in LANGS:
            above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = MARKER.search(above)
            assert m, f"{page}:{i + 1}: a ```{lang} block without a <!-- doc-test: run|parse|fragment --> marker"
            found.append(Block(page, i + 1, lang, m.group(1), bool(m.group(2)), "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return found


BLOCKS = [b for page in PAGES for b in blocks(page)]


def _param(block: Block):
    return pytest.param(block, id=block.id, marks=[pytest.mark.slow] if block.slow else [])


def _of(kind: str, slow: bool | None = None) -> list:
    return [_param(b) for b in BLOCKS if b.kind == kind and (slow is None or b.slow == slow)]


# -- the shape of the README ----------------------------------------------------------------------


def commands(code: str) -> list[list[str]]:
    """The shell commands of a block: continuation lines joined, comments dropped, split at ``&&``,
    leading ``VAR=value`` assignments removed. A ``console`` block's commands are its ``$ `` lines."""
    text = code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.startswith("$ "):
            line = line[2:]
        argv = shlex.split(line, comments=True)
        while argv:
            cut = argv.index("&&") if "&&" in argv else len(argv)
            cmd = argv[:cut]
            while cmd and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]):
                cmd = cmd[1:]
            if cmd:
                out.append(cmd)
            argv = argv[cut + 1:]
    return out


def test_the_two_setup_commands_come_first():
    first = next(b for b in BLOCKS if b.page == "README.md")
    assert [" ".join(c) for c in commands(first.code)] == ["bash scripts/serve.sh", "bash scripts/test.sh"]
    assert "CI=1 bash scripts/test.sh" in first.code
    serve_sh = (ROOT / "scripts/serve.sh").read_text()
    assert "bash scripts/install.sh" in serve_sh and 'exec specdec serve "$@"' in serve_sh
    assert "bash scripts/install.sh" in (ROOT / "scripts/test.sh").read_text()
    start = (DOCS / "getting-started.md").read_text()
    assert "python3 -m venv" in start and "scripts/install.sh" in start


def test_the_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) < 200, "the README is a front page: details go to docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert "docs/index.md" in local and len(local) >= 10, local
    broken = [link for link in local if not (ROOT / link).exists()]
    assert not broken, f"README links to missing files: {broken}"
    nav = (ROOT / "mkdocs.yml").read_text()
    for link in local:
        if link.startswith("docs/") and link.endswith(".md"):
            assert link[len("docs/"):] in nav, f"{link} is not in mkdocs.yml's nav"


def test_every_block_is_tested():
    assert BLOCKS and {b.kind for b in BLOCKS} == {"run", "parse", "fragment"}
    assert not [b.id for b in BLOCKS if b.lang == "python" and b.kind == "parse"], "python blocks run or compile"
    for page in PAGES:
        assert "path/to/" not in page.read_text(), f"{page}: a placeholder path: use the shipped models"


# -- the site builds strictly ------------------------------------------------------------------------


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    require_package("mkdocs", "pip install -e '.[docs]' (also in the test extra)")
    require_package("material", "pip install mkdocs-material (the docs extra)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_site_builds_strictly(tmp_path):
    result = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    page = (tmp_path / "site" / "observability" / "metrics" / "index.html").read_text()
    from specdec.serving.metrics_reference import metric_docs

    names = [m.name for m in metric_docs()]
    assert len(names) > 30 and all(name in page for name in names), "the metrics reference misses a series"
    assert "<!-- metrics-reference -->" not in page, "the hook did not fill the reference in"
    _check_cli_reference(tmp_path / "site")
    for html in ("index.html", "getting-started/index.html", "performance/index.html"):
        assert (tmp_path / "site" / html).is_file(), html
    performance = (tmp_path / "site" / "performance" / "index.html").read_text()
    for plot in ("throughput-vs-concurrency.png", "specdec-bench.png"):  # the benchmarks' own plots
        assert f"assets/plots/{plot}" in performance, plot
        assert (tmp_path / "site" / "assets" / "plots" / plot).read_bytes().startswith(b"\x89PNG"), plot


def _check_cli_reference(site: Path) -> None:
    """The built CLI and environment pages name every subcommand, every flag and every variable the parsers
    have (specdec.entrypoints.cli_reference reads the parsers; this reads the parsers again, and the pages)."""
    import argparse
    import html

    from specdec.entrypoints.cli import SUBCOMMANDS, build_parser

    cli = html.unescape((site / "reference" / "cli" / "index.html").read_text())
    env = html.unescape((site / "reference" / "environment" / "index.html").read_text())
    assert "<!-- cli-reference -->" not in cli and "<!-- env-reference -->" not in env
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(SUBCOMMANDS)
    for name, subparser in sub.choices.items():
        assert f"specdec {name}" in cli, name
        for action in subparser._actions:
            for flag in action.option_strings:
                assert flag in cli, (name, flag)
            found = re.search(r"\(env (SPECDEC_[A-Z0-9_]+)", action.help or "")
            if found:
                assert found.group(1) in env and found.group(1) in cli, (name, found.group(1))


@pytest.mark.parametrize("broken, named", [("[nowhere](no-such-page.md)", "no-such-page.md"),
                                           ("[there](exactness.md#no-such-anchor)", "no-such-anchor")])
def test_a_broken_link_fails_the_build(tmp_path, broken, named):
    """The negative control of the strict build: the same site with one dead link, or one dead anchor."""
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "mkdocs_hooks.py", copy / "scripts")
    page = copy / "docs" / "offline.md"
    page.write_text(page.read_text() + f"\nSee {broken}.\n")
    result = _mkdocs_build(copy / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert named in result.stdout + result.stderr


def test_every_page_is_in_the_nav():
    nav = set(re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    for page in DOCS.rglob("*.md"):
        assert str(page.relative_to(DOCS)) in nav, f"{page} is not in mkdocs.yml's nav"


def test_the_speculative_config_table_names_every_key():
    from dataclasses import fields

    from specdec.config import SUPPORTED_METHODS, SpeculativeConfig

    text = (DOCS / "speculative" / "index.md").read_text()
    for f in fields(SpeculativeConfig):
        assert f"`{f.name}`" in text, f"docs/speculative/index.md does not describe the key {f.name!r}"
    for method in SUPPORTED_METHODS:
        assert f"`{method}`" in text, method


def test_the_extras_the_docs_name_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for page in PAGES:
        for name in re.findall(r"\.\[(\w+)\]", page.read_text()):
            assert name in extras, f"{page.name} names the extra [{name}], which pyproject.toml does not have"


# -- parse: the commands are ones the CLI takes ---------------------------------------------------


def _check_specdec(argv: list[str], monkeypatch) -> None:
    from specdec.entrypoints import cli

    for name in [n for n in os.environ if n.startswith("SPECDEC_")]:
        monkeypatch.delenv(name)
    parser = cli.build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"`specdec {shlex.join(argv)}` does not parse: {err.getvalue().strip() or exc}")
    assert getattr(args, "command", None), argv


def _check_helm_set(key: str) -> None:
    node = yaml.safe_load((ROOT / "helm/specdec/values.yaml").read_text())
    for name in key.split("=", 1)[0].split("."):
        assert isinstance(node, dict) and name in node, f"helm --set {key}: no such value in values.yaml"
        node = node[name]


def check_command(cmd: list[str], monkeypatch) -> None:
    head = cmd[0]
    if head == "specdec":
        _check_specdec(cmd[1:], monkeypatch)
    elif head == "bash" and cmd[1].startswith("scripts/"):
        script = ROOT / cmd[1]
        assert script.is_file(), cmd
        subprocess.run(["bash", "-n", str(script)], check=True)
    elif cmd[:3] == ["python3", "-m", "venv"] or head in (".", "source"):
        pass  # making and entering a virtual environment
    elif head == "docker-compose":
        assert cmd[1] in ("up", "ps", "down", "logs", "config") and (ROOT / "docker-compose.yml").is_file(), cmd
    elif cmd[:2] == ["docker", "run"]:
        assert "--entrypoint" not in cmd or (ROOT / cmd[-1]).is_file(), cmd  # a script of this repository
    elif cmd[:2] == ["docker", "build"]:
        assert (ROOT / "Dockerfile").is_file() and cmd[-1] == "."
    elif head == "mkdocs":
        assert cmd[1] in ("serve", "build") and (ROOT / "mkdocs.yml").is_file(), cmd
    elif cmd[:4] == ["python", "-m", "pip", "install"]:
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for spec in cmd[4:]:
            m = re.fullmatch(r"(?:-e\s*)?\.\[(\w+)\]|-e", spec)
            assert m, f"pip install {spec}: only this checkout's extras"
            assert m.group(1) is None or m.group(1) in extras, spec
    elif head == "python" and cmd[1].startswith("benchmarks/"):
        script = ROOT / cmd[1]
        assert script.is_file(), cmd
        known = script.read_text() + (ROOT / "benchmarks" / "common.py").read_text()
        for flag in (a.split("=", 1)[0] for a in cmd[2:] if a.startswith("--")):
            assert f'"{flag}"' in known, f"{cmd[1]} takes no {flag}"
    elif head == "python" and cmd[1].startswith("scripts/") and cmd[1].endswith(".py"):
        script = ROOT / cmd[1]
        assert script.is_file(), cmd
        for flag in (a.split("=", 1)[0] for a in cmd[2:] if a.startswith("--")):
            assert f'"{flag}"' in script.read_text(), f"{cmd[1]} takes no {flag}"
    elif cmd[:3] == ["python", "-m", "pytest"]:
        for arg in cmd[3:]:
            if not arg.startswith("-") and "/" in arg:
                assert (ROOT / arg.split("::", 1)[0]).exists(), f"pytest {arg}: no such test path"
    elif head == "curl":
        assert any(a.startswith("http://localhost:8000/") for a in cmd), cmd
    elif cmd[:2] == ["docker", "push"] or cmd[:2] == ["helm", "test"] or head == "kubectl":
        pass  # a registry, a cluster
    elif cmd[:2] == ["helm", "install"]:
        assert (ROOT / cmd[3]).is_dir(), cmd
        for flag, value in zip(cmd, cmd[1:]):
            if flag == "--set":
                _check_helm_set(value)
    else:
        pytest.fail(f"the docs run `{shlex.join(cmd)}`, which this test does not know how to check")


@pytest.mark.parametrize("block", _of("parse"))
def test_parse_blocks(block: Block, monkeypatch):
    assert block.lang != "python"
    cmds = commands(block.code)
    assert cmds, block.id
    for cmd in cmds:
        check_command(cmd, monkeypatch)


@pytest.mark.parametrize("block", _of("fragment"))
def test_fragments_compile(block: Block):
    compile(block.code, block.id, "exec", dont_inherit=True)


# -- run: against a tiny served stack, or offline ------------------------------------------------


@pytest.fixture(scope="module")
def stack(target_dir, good_draft_dir):
    from tests.gateway.openai.http_helpers import serve

    s = serve(target_dir, good_draft_dir, api_key=None, k=2, served_model_name=SERVED_AS)
    yield s
    s.stop(grace=0)


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory):
    """PATH with `specdec` and `python` of this checkout (not whatever `specdec` is installed)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, line in (("specdec", f'exec "{sys.executable}" -m specdec.entrypoints.cli "$@"'),
                       ("python", f'exec "{sys.executable}" "$@"')):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{line}\n")
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    return env


def _needs_server(block: Block) -> bool:
    return any(s in block.code for s in ("localhost:8000", "localhost:50050", "specdec bench"))


def _rewrite(code: str, stack) -> str:
    return (code.replace("localhost:8000", f"127.0.0.1:{stack.gateway.http_port}")
            .replace("localhost:50050", f"127.0.0.1:{stack.gateway.port}"))


@pytest.mark.heavy
@pytest.mark.parametrize("block", _of("run", slow=False))
def test_run_blocks(block: Block, request, tmp_path, shell_env, monkeypatch):
    stack = request.getfixturevalue("stack") if _needs_server(block) else None
    if block.lang == "python":
        code = _rewrite(block.code, stack) if stack else block.code
        monkeypatch.chdir(tmp_path)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            # as a script runs it: without this module's ``from __future__ import annotations`` (under which a
            # pydantic model of the snippet's could not resolve its annotations)
            exec(compile(code, block.id, "exec", dont_inherit=True), {"__name__": "__readme__"})
        assert out.getvalue().strip(), f"{block.id} printed nothing"
        return
    if "openssl" in block.code and shutil.which("openssl") is None:
        missing("openssl is not installed: apt-get install openssl")
    env = dict(shell_env)
    if stack is not None:
        env["SPECDEC_BENCH_BASE_URL"] = f"http://127.0.0.1:{stack.gateway.http_port}"
        env["SPECDEC_BENCH_PROGRESS"] = "false"
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    if "specdec bench" in block.code:
        assert "Output token throughput" in result.stdout and "Acceptance rate" in result.stdout
    if "result.json" in block.code:
        rate = result.stdout.strip().splitlines()[-1].split()
        assert float(rate[0]) > 0 and 0 <= float(rate[1]) <= 1, result.stdout
    if "openssl" in block.code:
        made = {p.name for p in tmp_path.iterdir()}
        assert {"ca.pem", "client.pem", "client.key", *(f"{n}.{e}" for n in ("target", "draft", "gateway")
                                                        for e in ("pem", "key"))} <= made, made


@pytest.mark.parametrize("block", _of("run", slow=True))
def test_run_slow_blocks(block: Block, tmp_path, shell_env):
    """The offline snippets, on the real models (each in a process of its own)."""
    assert block.lang == "python" and not _needs_server(block)
    result = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=shell_env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{block.id} failed:\n{result.stderr[-4000:]}"
    assert result.stdout.strip() or "print(" not in block.code, block.id


# -- numbers name their machine and command ------------------------------------------------------------

# a table that reports speed: a ratio against the target alone (1.23x, 1.23×) or a throughput / latency column
_SPEED = re.compile(r"\d\.\d+\s?[x×](?!\w)|\d\s?(ms|tok/s|tokens/s)\b")
_SPEED_HEADER = re.compile(r"tokens/s|tok/s|\bms\b|speed-up|× target|x the target")
_SCRIPT = re.compile(r"bench_\w+\.py|specdec bench|benchmarks/")
_MACHINE = re.compile(r"EPYC|Xeon|avx|AMX")
CONTEXT_LINES = 14  # a table's citation: in the paragraph above it, or the lines under it


def speed_tables(path: Path) -> list[tuple[int, list[str]]]:
    """(first line, the lines) of each Markdown table of ``path`` whose cells report speed."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            body = lines[i + 2:j]
            if _SPEED_HEADER.search(lines[i]) or any(_SPEED.search(row) for row in body):
                out.append((i, lines))
            i = j
        else:
            i += 1
    return out


def uncited_speed_tables(path: Path) -> list[str]:
    """The speed tables of ``path`` that name no script or no machine in the lines around them."""
    missing = []
    for start, lines in speed_tables(path):
        end = next((k for k in range(start, len(lines)) if not lines[k].startswith("|")), len(lines))
        context = "\n".join(lines[max(0, start - CONTEXT_LINES):end + CONTEXT_LINES // 2])
        lacks = [what for what, pattern in (("script", _SCRIPT), ("machine", _MACHINE)) if not pattern.search(context)]
        if lacks:
            missing.append(f"{path.name}:{start + 1} lacks its {' and '.join(lacks)}")
    return missing


def test_every_speed_table_names_its_script_and_machine():
    """A headline table (speed-ups, tokens/s, ms) cites the benchmark that measured it and the machine, in the
    lines around it: a reader can rerun it and knows where it holds."""
    assert sum(len(speed_tables(page)) for page in PAGES) >= 15  # the check reads the tables it should
    missing = [m for page in PAGES for m in uncited_speed_tables(page)]
    assert not missing, "\n".join(missing)


def test_an_uncited_speed_table_is_found(tmp_path):
    """The negative control: the same table with and without its citation."""
    table = "| setup | tokens/s |\n|---|---|\n| target alone | 25.7 |\n| pair | 29.6 (1.18×) |\n"
    page = tmp_path / "page.md"
    page.write_text("Some prose.\n\n" + table)
    assert uncited_speed_tables(page) == ["page.md:3 lacks its script and machine"]
    page.write_text("Measured by `benchmarks/bench_x.py` on a 2-vCPU AMD EPYC:\n\n" + table)
    assert uncited_speed_tables(page) == []
