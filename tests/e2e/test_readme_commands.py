"""Every command the README and the docs site (docs/*.md) show runs, so the documentation cannot
rot.

The ```bash blocks of README.md and docs/*.md are parsed; each `tandem` / `torchrun` command runs as
written, from a scratch directory that links the repository's recipes/, with only tiny-model
overrides appended. A command shown on several pages runs once.

- `pip install ... && X` lines test X; `python -m pytest` is what this suite is, and is not recursed
  into.
- `tandem train` / `torchrun` commands train 2 steps with an evaluation at step 2 (small prompt
  set), so each documented layout also shows it logs `eval/*`. The torchrun layouts that
  `tests/distributed/test_cli_layouts.py` runs (and compares with one process) are not run twice.
- `tandem train recipes/tiny.yaml` is the pretraining run the other flows start from: it writes
  `runs/tiny` (the recipe's own run.dir) in the scratch directory, where the fine-tuning, eval,
  export and report commands find it as written. A fine-tune of it writes its recipe's run.dir there
  too (the docs evaluate and export it), after the documented `tandem generate` that writes its
  `data.paths`.
- `tandem preprocess` runs as written on the example data under docs/ (linked into the scratch
  directory);
- `tandem eval` gets a 2-prompt budget appended, `tandem generate` a 6-token one (and its prompt
  file); `tandem launch slurm` must carry `--check` or `--dry-run` (nothing is submitted); `--help`
  runs as is. These cheap commands run in this process through the console script's entry point
  (`tandem.trainer.cli.main`), training commands in their own.
- ```python blocks (vLLM's serve.py) need vLLM in its own environment: they must compile and make
  only the calls `tests/e2e/vllm_driver.py` makes, which `tests/e2e/test_vllm_serving.py` runs
  against a real vLLM server. ```sh blocks are for hardware the suite does not have
  (bench/gpu_check.py, whose CPU form `tests/e2e/test_bench_gpu_check.py` runs).

The suite runs on 2 cores over its time budget, so the docs show cheap forms (`--check`, `--help`)
where they can, and at most EXPENSIVE_BUDGET distinct training commands run here.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest

from tests.conftest import TINY_OVERRIDES

pytestmark = [pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
VLLM_DRIVER = os.path.join(ROOT, "tests", "e2e", "vllm_driver.py")
# the suite's tiny model and corpus slice (tests/conftest.py), with 2 kv heads for tp=2, 2 steps and
# an evaluation at step 2 (later overrides win)
TINY = TINY_OVERRIDES + [
    "model.num_kv_heads=2", "train.warmup_steps=1", "train.max_steps=2", "checkpoint.interval=0",
    "eval.interval=2", "eval.num_prompts=2", "eval.prompt_len=8", "eval.max_new_tokens=6",
    "eval.batch_size=2", "eval.loss_batches=1",
]
EVAL_BUDGET = ["--num-prompts", "2", "--prompt-len", "8", "--max-new-tokens", "6", "--batch-size",
               "2"]
QWEN4_TINY = ["model.num_layers=4", "model.indexer_budget=8", "model.indexer_warmup_steps=1"]
"""On top of TINY for a Qwen4-Exp recipe: its hybrid schedule's QSA layer (every 4th) kept, a
selection smaller than the 32-token window, and the sparse stage reached at step 2."""
GENERATE_BUDGET = ["--max-new-tokens", "6", "--batch-size", "2"]
GENERATE_PROMPTS = '{"text": "def main():\\n"}\n{"text": "import os\\n"}\n'
"""The prompt file a documented `tandem generate` reads, written into the workspace when missing
(the docs show its lines in a json block: the default job's tokenizer has no chat template, so text
only)."""
PRETRAIN = "tandem train recipes/tiny.yaml"
PRETRAIN_DIR = "runs/tiny"  # recipes/tiny.yaml's run.dir, which the docs' later commands read
EXPENSIVE_BUDGET = 4  # training commands this file may run (each ~10-17 s on 2 cores)


def blocks(lang: str, path: str):
    with open(path) as f:
        return re.findall(rf"^```{lang}\n(.*?)^```", f.read(), flags=re.S | re.M)


def doc_commands():
    """{command: [pages showing it]} of the runnable commands of the bash blocks, as written, in
    order."""
    out = {}
    for path in PAGES:
        for block in blocks("bash", path):
            for line in block.splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                for part in (p.strip() for p in line.split("&&")):
                    if part.startswith("pip ") or "-m pytest" in part:
                        continue
                    out.setdefault(part, []).append(os.path.relpath(path, ROOT))
    return out


SHOWN = doc_commands()
COMMANDS = list(SHOWN)


def cli_layouts_command(command: str):
    """The torchrun layout of `tests/distributed/test_cli_layouts.py` this command is, if any: that
    test runs the same launcher, recipe and parallel flags (tiny overrides appended, 3 steps and an
    evaluation) and checks losses and acceptance against one process, so it is not run here too."""
    from tests.distributed.test_cli_layouts import LAYOUTS, RECIPE

    argv = shlex.split(command)
    prefix = ["torchrun", "--nproc-per-node"]
    if argv[:2] != prefix or argv[3:7] != ["--no-python", "tandem", "train",
                                           os.path.relpath(RECIPE, ROOT)]:
        return None
    world, flags = int(argv[2]), argv[7:]
    return next(((w, o) for w, o in LAYOUTS if w == world and o == flags), None)


def is_training(command: str) -> bool:
    argv = shlex.split(command)
    return (argv[0] == "torchrun" or argv[:2] == ["tandem", "train"]) and "--help" not in argv


RUN_HERE = [c for c in COMMANDS if cli_layouts_command(c) is None]


def recipe_run_dir(command: str):
    """The run.dir of a `tandem train RECIPE` command's recipe (no run.dir override), else None."""
    import yaml

    argv = shlex.split(command)
    if argv[:2] != ["tandem", "train"] or any(a.startswith("run.dir=") for a in argv):
        return None
    with open(os.path.join(ROOT, argv[2])) as f:
        return (yaml.safe_load(f).get("run") or {}).get("dir")


FINETUNES = {d: c for c in COMMANDS if is_training(c) and PRETRAIN_DIR in c
             and (d := recipe_run_dir(c))}
"""{run dir: the documented fine-tune of the pretraining run that writes it}: later commands read
it."""


def test_docs_show_one_example_per_flow():
    readme = [c for c, pages in SHOWN.items() if "README.md" in pages]
    flows = {"pretrain": PRETRAIN, "slurm launch": "tandem launch slurm ",
             "generate": "tandem generate ",
             "fine-tuning": "tandem train recipes/finetune_mtp_selfdistill.yaml",
             "evaluation": "tandem eval ", "serving": "tandem export "}
    for flow, start in flows.items():
        assert any(c.startswith(start) for c in readme), (flow, readme)
    assert any(c.startswith("torchrun") for c in readme), readme
    # README, flagship, qwen4_exp
    assert sum(c.startswith("torchrun") for c in COMMANDS) >= 3, COMMANDS
    # the docs' fine-tuning, eval and export examples read what the pretraining command writes
    with open(os.path.join(ROOT, "recipes", "tiny.yaml")) as f:
        assert f"dir: {PRETRAIN_DIR}\n" in f.read()
    # the README's fine-tuning flow: generate -> fine-tune on what it wrote -> evaluate -> export
    # that run
    (ft_dir, ft), = [(d, c) for d, c in FINETUNES.items() if c.startswith(flows["fine-tuning"])]
    gen = [c for c in readme if c.startswith("tandem generate ")]
    assert any(f"data.paths=[{shlex.split(g)[shlex.split(g).index('--out') + 1]}]" in ft
               for g in gen), (gen, ft)
    for flow in ("tandem eval --checkpoint ", "tandem export --checkpoint "):
        assert any(c.startswith(flow + ft_dir) for c in readme), (flow, ft_dir)


def test_training_commands_fit_the_suite_budget():
    """Each documented training command costs the suite 10-17 s: show cheap forms instead of new
    ones."""
    expensive = [c for c in RUN_HERE if is_training(c)]
    assert len(expensive) <= EXPENSIVE_BUDGET, expensive


UNBUDGETED_BENCHES = {"bench/layout_compile.py"}
"""Named by the pages, run by no test: 8 compiled ranks have no budgeted form
(tests/distributed/test_compile_layout.py trains that layout compiled against one process)."""


def test_commands_are_in_bash_blocks():
    """A command in an unlabelled or other-language block would escape this test. `sh` blocks
    show the benchmarks in their full (hardware or hours) form: no `tandem` or `torchrun` line may
    stand there, and each script they run is run by a test of its own in a budgeted form."""
    tests_text = "\n".join(open(f).read() for f in glob.glob(os.path.join(ROOT, "tests", "**",
                                                                          "*.py"), recursive=True))
    for path in PAGES:
        with open(path) as f:
            text = f.read()
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
            if lang in ("bash", "python"):
                continue
            lines = [x.strip() for x in body.splitlines()]
            assert not any(x.startswith(("tandem ", "torchrun ")) for x in lines), (path, lang,
                                                                                    body)
            if lang != "sh":
                continue
            for line in lines:
                script = re.match(r"python (bench/\w+\.py)", line)
                assert script or not line, f"{path}: an sh block runs {line!r}, not a bench script"
                assert script is None or os.path.exists(os.path.join(ROOT, script[1])), line
                assert script is None or script[1] in tests_text, f"{path}: no test runs {line!r}"
        # and every bench script a page names anywhere (text blocks, inline code)
        for script in re.findall(r"python (bench/\w+\.py)", text):
            assert os.path.exists(os.path.join(ROOT, script)), f"{path}: {script} does not exist"
            assert script in tests_text or script in UNBUDGETED_BENCHES, f"{path}: no test runs " \
                                                                          f"{script}"


def test_docs_torchrun_layouts_are_checked_by_the_cli_layout_test():
    """The docs' flagship torchrun layout of the tiny recipe is run (and compared with one process)
    by test_cli_layouts.py, not twice."""
    covered = [c for c in COMMANDS if cli_layouts_command(c)]
    assert len(covered) >= 1 and all(c not in RUN_HERE for c in covered), covered


def _llm_calls(tree):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id",
                                                                             None) == "LLM"]


def _imports(tree):
    return {(n.module,
             a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def test_python_snippets_make_the_calls_the_vllm_test_runs():
    """The serve.py snippets compile, import only what vllm_driver.py imports, and pass LLM() only
    keywords the driver passes, with MTP speculation (test_vllm_serving.py runs the driver against
    real vLLM)."""
    with open(VLLM_DRIVER) as f:
        driver = ast.parse(f.read())
    (driver_llm,) = _llm_calls(driver)
    driver_keywords = {k.arg for k in driver_llm.keywords}
    snippets = [(p, b) for p in PAGES for b in blocks("python", p)]
    assert any("README" in p for p, _ in snippets) and any("serving" in p for p,
                                                           _ in snippets), snippets
    for path, code in snippets:
        tree = ast.parse(compile(code, path, "exec", flags=ast.PyCF_ONLY_AST))
        assert _imports(tree) <= _imports(driver), (path, _imports(tree) - _imports(driver))
        calls = _llm_calls(tree)
        assert calls, path
        for call in calls:
            keywords = {k.arg: k.value for k in call.keywords}
            assert set(keywords) <= driver_keywords, (path, set(keywords) - driver_keywords)
            spec = ast.literal_eval(keywords["speculative_config"])
            assert spec["method"] == "mtp" and spec["num_speculative_tokens"] >= 1, (path, spec)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A scratch directory laid out like the repository for the docs' relative paths (recipes/
    linked), where `runs/...` are written."""
    ws = tmp_path_factory.mktemp("docs_workspace")
    os.symlink(os.path.join(ROOT, "recipes"), ws / "recipes")
    os.symlink(os.path.join(ROOT, "docs"), ws / "docs")  # the example data the docs' commands read
    return ws


def _run(argv, cwd):
    if argv[0] == "torchrun":  # the same launcher, from this interpreter
        argv = [sys.executable, "-m", "torch.distributed.run"] + argv[1:]
    bin_dir = os.path.dirname(sys.executable)
    # a free rendezvous port through torchrun's environment (the command line stays as written)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               OMP_NUM_THREADS="1",
               WANDB_MODE="disabled", PET_MASTER_PORT=str(_free_port()))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _check_training(command, proc, run_dir):
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in records if "loss/main" in r] == [1, 2]
    evals = [r for r in records if "eval/acceptance_length" in r]
    assert len(evals) == 1 and evals[0]["step"] == 2, (command, proc.stderr[-2000:])
    assert evals[0]["eval/identical_to_autoregressive"] == 1.0
    return evals


@pytest.fixture(scope="module")
def pretrained(workspace, corpus_cache):
    """The docs' pretraining command, run once: its run directory is `runs/tiny` in the
    workspace."""
    assert PRETRAIN in SHOWN, (f"the docs no longer show {PRETRAIN!r}, which their later examples "
                               "read")
    proc = _run(shlex.split(PRETRAIN) + TINY + [f"data.cache_dir={corpus_cache}"], workspace)
    run_dir = workspace / PRETRAIN_DIR
    _check_training(PRETRAIN, proc, run_dir)
    assert any(n.startswith("step_")
               for n in os.listdir(run_dir / "checkpoints")), "no final checkpoint"
    return run_dir


def _tandem_in_process(argv, cwd, capsys):
    """`tandem ARGS` through the console script's own entry point, in this process (no second import
    of torch and megatron-core: these commands cost seconds, not the interpreter's start-up)."""
    from tandem.trainer.cli import main

    assert argv[0] == "tandem"
    capsys.readouterr()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        rc = main(argv[1:])
    except SystemExit as exc:  # argparse's --help and usage errors
        rc = exc.code
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    return rc, out, err


def _generate(command, workspace, capsys):
    """A documented `tandem generate`, with its prompt file written when missing (rerunning it
    resumes)."""
    argv = shlex.split(command)
    prompts = workspace / argv[argv.index("--prompts") + 1]
    if not prompts.exists():
        prompts.write_text(GENERATE_PROMPTS)
    rc, out, err = _tandem_in_process(argv + GENERATE_BUDGET, workspace, capsys)
    assert rc == 0, err[-4000:]
    return (workspace / argv[argv.index("--out") + 1]).read_text().splitlines()


@pytest.fixture(scope="module")
def finetuned(workspace, corpus_cache, pretrained):
    """Runs a documented fine-tune once, into its recipe's run.dir in the workspace (the docs' eval
    and export read it there), after the documented generate that writes its data.paths."""
    done = {}

    def run(run_dir, capsys):
        if run_dir not in done:
            command = FINETUNES[run_dir]
            for g in (c for c in COMMANDS if c.startswith("tandem generate ")):
                out = shlex.split(g)[shlex.split(g).index("--out") + 1]
                if f"data.paths=[{out}]" in command and not (workspace / out).exists():
                    _generate(g, workspace, capsys)
            # the 2 generated records give the default 98/2 split no validation record: half and
            # half
            proc = _run(shlex.split(command) + TINY + [f"data.cache_dir={corpus_cache}",
                                                       "data.split=50,50,0"],
                        workspace)
            _check_training(command, proc, workspace / run_dir)
            done[run_dir] = True

    return run


@pytest.mark.parametrize("command", RUN_HERE)
def test_doc_command_runs(command, request, workspace, corpus_cache, tmp_path, capsys):
    argv = shlex.split(command)
    assert argv[0] in ("tandem", "torchrun"), f"unexpected command {command!r} in {SHOWN[command]}"
    if command == PRETRAIN:
        request.getfixturevalue("pretrained")
        return
    if PRETRAIN_DIR in command:  # reads (or writes beside) the pretraining run
        request.getfixturevalue("pretrained")
    for run_dir in FINETUNES:  # a documented fine-tune, or a command that reads what it wrote
        if command == FINETUNES[run_dir] or run_dir in argv[1:] or f"{run_dir}/" in command:
            request.getfixturevalue("finetuned")(run_dir, capsys)
    if command in FINETUNES.values():
        return
    if is_training(command):  # a process of its own, as a user runs it
        run_dir = tmp_path / "run"
        qwen4 = QWEN4_TINY if "qwen4" in command else []
        proc = _run(argv + TINY + qwen4 + [f"data.cache_dir={corpus_cache}",
                                          f"run.dir={run_dir}"], workspace)
        evals = _check_training(command, proc, run_dir)
        if qwen4:  # the QSA layer selects: its recall is logged, below 1
            assert 0 < evals[0]["eval/qsa_recall"] < 1, evals[0]
            # and `tandem eval` of the final checkpoint prints it too, as the in-loop evaluator did
            rc, out, err = _tandem_in_process(["tandem", "eval", "--checkpoint", str(run_dir),
                                               *EVAL_BUDGET], workspace, capsys)
            assert rc == 0, err[-4000:]
            recall = json.loads(out.strip().splitlines()[-1]).get("qsa_recall")
            assert recall == pytest.approx(evals[0]["eval/qsa_recall"], rel=1e-5), recall
        return
    if "--help" in argv:
        rc, out, err = _tandem_in_process(argv, workspace, capsys)
        assert rc == 0 and "usage:" in out, err[-2000:]
    elif argv[1:3] == ["launch", "slurm"]:
        assert "--check" in argv or "--dry-run" in argv, f"{command!r} would submit a job"
        rc, out, err = _tandem_in_process(argv, workspace, capsys)
        assert rc == 0, err[-4000:]
        assert "--dry-run" in argv or "layout ok" in out, out
    elif argv[1] == "eval":
        rc, out, err = _tandem_in_process(argv + EVAL_BUDGET, workspace, capsys)
        assert rc == 0, err[-4000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert 1.0 <= result["acceptance_length"] <= 3.0, result  # TINY trains K=2
    elif argv[1] == "generate":
        records = _generate(command, workspace, capsys)
        assert len(records) == 2 and all(json.loads(r)["response_ids"] for r in records), records
    elif argv[1] == "export":
        rc, out, err = _tandem_in_process(argv, workspace, capsys)
        assert rc == 0, err[-4000:]
        out_dir = workspace / argv[argv.index("--out") + 1]
        assert (out_dir / "config.json").is_file(), os.listdir(out_dir)
    elif argv[1] == "preprocess":
        rc, out, err = _tandem_in_process(argv, workspace, capsys)
        assert rc == 0 and out.startswith("preprocessed "), err[-4000:]
        prefix = workspace / argv[argv.index("--output-prefix") + 1]
        assert os.path.isfile(f"{prefix}.bin") and ("--chat" not in argv
                                                    or os.path.isfile(f"{prefix}_loss_mask.bin"))
    elif argv[1] == "report":
        rc, out, err = _tandem_in_process(argv, workspace, capsys)
        assert rc == 0, err[-4000:]
        page = out.strip().splitlines()[-1]
        assert os.path.isfile(os.path.join(workspace, page)), out
    else:
        pytest.fail(f"no check for {command!r} (in {SHOWN[command]}): teach this test how to run "
                    "it cheaply")
