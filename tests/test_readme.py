"""Every ```python snippet of README.md pastes into a fresh `python` REPL and
runs twice in a row (issue 23): each is fed to `python -i` on stdin, twice
(so a `for` block without the blank line that ends it, or a snippet that
cannot run again, fails here as it would for a user).

A snippet that starts with "continues the snippet above" runs after the one
before it; 'continues the snippet of "SECTION"' after the first one of that
section (## or ###)."""

import code as code_lib
import os
import re
import subprocess
import sys
import textwrap

import jobs
import pytest

README = os.path.join(jobs.REPO, "README.md")
# Run twice in a fresh REPL by default: the ones issue 23 found broken (`for` blocks
# without their blank line, after the training snippet they continue; a checkpoint that
# could not be written twice) and a quick one. Every snippet is checked as REPL input by
# default (test_snippet_is_valid_repl_input) and run twice with -m slow.
DEFAULT = {"Checkpoints #1", "ZeRO-3 that fits: FSDP units, scanned layers, hybrid sharding #2",
           "Multi-host #1", "nnx models #1"}


def snippets() -> list[tuple[str, str, str]]:
  """``(id, section, code)`` of every ```python block, in README order."""
  found, section, lines = [], "", open(README).read().splitlines()
  i = 0
  while i < len(lines):
    heading = re.match(r"#{2,3} (.*)", lines[i])
    if heading:
      section = heading.group(1).strip()
    fence = re.match(r"^(\s*)```python\s*$", lines[i])
    if fence:
      indent, body = fence.group(1), []
      i += 1
      while not re.match(rf"^{indent}```\s*$", lines[i]):
        body.append(lines[i])
        i += 1
      code = textwrap.dedent("\n".join(body)) + "\n"
      number = sum(1 for _, s, _ in found if s == section) + 1
      found.append((f"{section} #{number}", section, code))
    i += 1
  return found


def with_predecessor(index: int, all_snippets) -> str:
  _, _, code = all_snippets[index]
  first = code.splitlines()[0]
  if "continues the snippet above" in first:
    return with_predecessor(index - 1, all_snippets) + "\n" + code
  named = re.search(r'continues the snippet of "([^"]+)"', first)
  if named:
    j = next(k for k, (_, s, _) in enumerate(all_snippets) if s == named.group(1))
    return with_predecessor(j, all_snippets) + "\n" + code
  return code


ALL = snippets()


def test_the_readme_has_its_snippets():
  assert len(ALL) >= 14 and DEFAULT <= {name for name, _, _ in ALL}
  assert any("ZeRO(stage=3)" in code and "make_mesh" in code for _, _, code in ALL)
  # its "Tests" section says how many run by default (it said three while four did)
  count = {3: "three", 4: "four", 5: "five", 6: "six"}[len(DEFAULT)]
  assert f"pastes {count} of them twice" in " ".join(open(README).read().split())


class _Paste(code_lib.InteractiveConsole):
  """The REPL's reading of pasted lines, without running them: records what
  it would report as a SyntaxError (e.g. a line right after a `for` block)."""

  def __init__(self):
    super().__init__()
    self.errors: list[str] = []

  def runcode(self, code):  # noqa: ARG002  (compiled, not run)
    return None

  def showsyntaxerror(self, filename=None, **kwargs):  # noqa: ARG002
    self.errors.append(str(sys.exc_info()[1]))


@pytest.mark.parametrize("index", [pytest.param(i, id=name) for i, (name, _, _) in
                                   enumerate(ALL)])
def test_snippet_is_valid_repl_input(index):
  console = _Paste()
  for n, line in enumerate((with_predecessor(index, ALL) + "\n").splitlines() * 2, 1):
    console.push(line)
    assert not console.errors, f"line {n} ({line!r}) of the paste: {console.errors}"


def test_the_repl_check_catches_a_for_block_without_its_blank_line():
  console = _Paste()
  for line in ["for i in range(2):", "  x = i", "print(x)"]:
    console.push(line)
  assert console.errors


@pytest.mark.parametrize(
    "index", [pytest.param(i, id=name, marks=[] if name in DEFAULT else [pytest.mark.slow])
              for i, (name, _, _) in enumerate(ALL)])
def test_snippet_pastes_into_a_fresh_repl_twice(index, tmp_path):
  code = with_predecessor(index, ALL)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOLL_")}  # a fresh shell
  env["PYTHONPATH"] = jobs.REPO  # the checkout, as after `pip install -e .`
  paste = code + "\n"  # the Enter after a paste: ends a block left open at the end
  out = subprocess.run([sys.executable, "-i", "-q"], input=paste + paste, cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
  problems = [line for line in out.stderr.splitlines()
              if line.startswith(("Traceback", "SyntaxError", "IndentationError"))
              or re.match(r"^\w+(Error|Exception): ", line)]
  assert out.returncode == 0 and not problems, f"{out.stderr[-4000:]}\n--- stdout:\n" \
      f"{out.stdout[-2000:]}"


# ```bash blocks whose commands run as written (their /tmp/... paths moved into a temporary
# directory) and whose commented output lines are checked against what the commands print:
# (section, its bash block's number, the /tmp paths it uses); the slow ones with -m slow.
BASH_BLOCKS = [
    # Slow too (17 s unloaded; the default run is over its 10 minutes): tests/run/
    # test_experiments.py and test_messages.py run the same train / resume commands by default.
    pytest.param("Experiments and configs", 1, ("/tmp/again",), marks=pytest.mark.slow),
    pytest.param("Profiling and communication share", 1, ("/tmp/jaxcoll-runs",),
                 marks=pytest.mark.slow),
    pytest.param("Evaluating a checkpoint (eval-only)", 1, ("/tmp/ev_evals", "/tmp/ev"),
                 marks=pytest.mark.slow),
    pytest.param("Incidents and rollback", 1, ("/tmp/jaxcoll-runs",), marks=pytest.mark.slow),
]


def bash_block(section: str, number: int) -> str:
  """The ``number``-th ```bash block under the heading ``section`` (## or ###)."""
  lines, current, found = open(README).read().splitlines(), "", []
  for i, line in enumerate(lines):
    heading = re.match(r"#{2,3} (.*)", line)
    if heading:
      current = heading.group(1).strip()
    if current == section and line.strip() == "```bash":
      end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
      found.append("\n".join(lines[i + 1:end]) + "\n")
  return found[number - 1]


def shown_output(block: str) -> list[str]:
  """The output lines a block shows as comments: `#   ... TEXT`, `# incident ...`,
  `# done: ...` (a line's own `...` ends cut off: the rest is not compared)."""
  shown, remark = [], 0  # remark: the open parentheses of a remark over several lines
  for line in block.splitlines():
    m = re.match(r"#\s+(\.\.\. )?(.*)", line.strip())
    if not m or line.strip().startswith("# ") and not re.match(
        r"# (incident at|done:|  )", line.strip()):
      continue
    text = m.group(2).strip()
    if remark or text.startswith("("):  # a remark, not output
      remark += text.count("(") - text.count(")")
      continue
    shown.append(re.split(r"\.\.\.(?:$| )", text)[0].strip())
  return [s for s in shown if s]


def test_shown_output_reads_the_commented_lines():
  block = ("python -m x --workdir=/tmp/a\n#   ... Starting: 6 steps, workdir /tmp/a\n"
           "#   ... nothing to do (steps=6) in /tmp/a; pass a larger ...\n"
           "#   (exit 0; nothing written: only\n#   a lock comes and goes)\n"
           "# The same remedy on purpose\n"
           "# done: 40 steps, params sha256 64646c2d...\n# incident at step 25: x; rolled to\n"
           "#   checkpoint 20\n")
  assert shown_output(block) == ["Starting: 6 steps, workdir /tmp/a",
                                 "nothing to do (steps=6) in /tmp/a; pass a larger",
                                 "done: 40 steps, params sha256 64646c2d",
                                 "incident at step 25: x; rolled to", "checkpoint 20"]


@pytest.mark.parametrize("section, number, paths", BASH_BLOCKS)
def test_bash_block_runs_and_prints_what_it_shows(section, number, paths, tmp_path):
  block = bash_block(section, number)
  for path in paths:  # longest first where one is the other's prefix
    block = block.replace(path, str(tmp_path / os.path.basename(path)))
  env = jobs.clean_env()
  del env["JAXCOLL_CPU_DEVICES"]  # as in a fresh shell: the commands' own default (8)
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # `python`
  out = subprocess.run(["bash", "-e", "-c", block], cwd=jobs.REPO, env=env,
                       capture_output=True, text=True, timeout=900, check=False)
  printed = out.stdout + out.stderr
  assert out.returncode == 0, printed[-4000:]
  for shown in shown_output(block):
    # a time in seconds is this run's own; every other figure is the run's
    pattern = re.sub(r"\d+\\\.\d+\\ s\b", r"\\d+\\.\\d+\\ s", re.escape(shown))
    assert re.search(pattern, printed), f"{shown!r} not in:\n{printed[-4000:]}"


def test_example_paths_never_shadow_the_package():
  """The README's and configs' example paths keep their runs out of a directory named like an
  importable package: after ``--workdir=/tmp/jaxcoll/smoke``, ``import jaxcoll`` in a Python
  started in /tmp found the run's directory (a namespace package, before an editable
  install's finder) and had no attributes."""
  texts = {README: open(README).read()}
  configs = os.path.join(jobs.REPO, "configs")
  for name in sorted(os.listdir(configs)):
    if name.endswith(".py"):
      texts[os.path.join(configs, name)] = open(os.path.join(configs, name)).read()
  found = [(path, m.group(0)) for path, text in texts.items()
           for m in re.finditer(r"/tmp/(jaxcoll|experiments|configs|tests)(?=[/\s'\"`]|$)",
                                text)]
  assert not found, found
