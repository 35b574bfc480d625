"""wandb without an API key: an offline run in the run directory holding the same series as
metrics.jsonl (per-depth losses, acceptance length), resumed under the same run id, no key
logged."""

import glob
import json
import os
import struct

import pytest

from tandem.trainer.loop import train
from tandem.trainer.recipe import load_config

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")


def wandb_records(run_file):
    """The protobuf `Record`s of a .wandb file: LevelDB-log framing (32 KiB blocks, 7-byte record
    headers); wandb 0.31 ships no Python reader for its own format."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = open(run_file, "rb").read()
    assert raw[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (2, 3):  # first / middle fragment
            pending += data
            continue
        if kind == 4:  # last fragment
            data, pending = pending + data, b""
        if kind not in (1, 4):
            continue
        record = pb.Record()
        record.ParseFromString(data)
        records.append(record)
    return records


def wandb_history(run_file):
    """History rows of a .wandb file, as {key: value}."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]


@pytest.mark.slow
def test_offline_wandb_run_holds_the_metric_series(tiny_overrides, monkeypatch, tmp_path,
                                                   capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc credentials either
    overrides = tiny_overrides + ["logging.wandb=true", "eval.interval=2", "eval.num_prompts=2",
                                  "eval.max_new_tokens=8",
                                  "eval.prompt_len=8", "eval.batch_size=2", "eval.loss_batches=1"]
    cfg = load_config(RECIPE, overrides + ["train.max_steps=4", "checkpoint.interval=2"])
    train(cfg)
    runs = glob.glob(os.path.join(cfg.run.dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1
    rows = wandb_history(runs[0])
    with open(os.path.join(cfg.run.dir, "metrics.jsonl")) as f:
        jsonl = [json.loads(line) for line in f]
    assert [r["_step"] for r in rows] == [r["step"] for r in jsonl] == [1, 2, 3, 4]
    for row, rec in zip(rows, jsonl):
        for key in ("loss/main", "loss/mtp_1", "loss/mtp_2"):
            assert row[key] == pytest.approx(rec[key])
    assert [r["step"] for r in jsonl if "eval/acceptance_length" in r] == [2, 4]
    assert [r["_step"] for r in rows if "eval/acceptance_length" in r] == [2, 4]
    # the decoded samples: a wandb table at each evaluation, rows as in eval_samples.jsonl
    tables = [r for r in rows if r.get("eval/samples/_type") == "table-file"]
    assert [r["_step"] for r in tables] == [2, 4] and tables[0]["eval/samples/nrows"] == 2
    with open(os.path.join(os.path.dirname(runs[0]), "files", tables[1]["eval/samples/path"])) as f:
        table = json.load(f)
    with open(os.path.join(cfg.run.dir, "eval_samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert [s["step"] for s in samples] == [2, 2, 4, 4]
    col = table["columns"].index("continuation")
    assert [row[col] for row in table["data"]] == [s["continuation"] for s in samples[2:]]
    run_id = open(os.path.join(cfg.run.dir, "wandb_run_id.txt")).read().strip()
    # the resumed job continues the same wandb run id
    train(load_config(RECIPE, overrides + ["train.max_steps=5"]), resume=True)
    assert open(os.path.join(cfg.run.dir, "wandb_run_id.txt")).read().strip() == run_id
    folders = glob.glob(os.path.join(cfg.run.dir, "wandb", "offline-run-*"))
    assert len(folders) == 2 and len({os.path.basename(p).split("-")[-1] for p in folders}) == 1
    # the printed upload command names every attempt's folder (the last one alone lost the rest)
    sync = capsys.readouterr().err.split("upload later with: wandb sync ")[-1].split()[0]
    assert sorted(glob.glob(sync)) == sorted(folders)


def test_api_key_never_reaches_the_run_directory(tiny_overrides, monkeypatch):
    secret = "sk-test-0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config(RECIPE, tiny_overrides + ["logging.wandb=true", "train.max_steps=1",
                                                "logging.entity=mtp-team"])
    train(cfg)
    # logging.entity names the wandb team the run belongs to
    (run_file,) = glob.glob(os.path.join(cfg.run.dir, "wandb", "offline-run-*", "run-*.wandb"))
    runs = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    assert runs and all(r.entity == "mtp-team" for r in runs)
    for path in glob.glob(os.path.join(cfg.run.dir, "**", "*"), recursive=True):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                assert secret.encode() not in f.read(), path


def test_wandb_mode_disabled_is_obeyed_with_a_key(tiny_overrides, monkeypatch):
    """`WANDB_MODE=disabled` with an API key set went online (Tandem passed mode="online"), and
    without a network failed after 90 s, leaving the run's files behind."""
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = load_config(RECIPE, tiny_overrides + ["logging.wandb=true", "train.max_steps=1"])
    assert train(cfg)["step"] == 1
    assert not glob.glob(os.path.join(cfg.run.dir, "wandb", "*run-*"))


@pytest.mark.parametrize("base_url", [None, "https://wandb.example.org"])
def test_credentials_are_looked_up_where_wandb_looks(monkeypatch, tmp_path, base_url):
    """A `wandb login` writes its key under the server wandb talks to (wandb 0.31's default is not
    api.wandb.ai; a self-hosted one is WANDB_BASE_URL), in $NETRC or ~/.netrc: Tandem looked for
    api.wandb.ai in ~/.netrc alone and ran offline, saying nothing."""
    import wandb

    from tandem.trainer.metrics import _wandb_has_credentials

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    if base_url:
        monkeypatch.setenv("WANDB_BASE_URL", base_url)
    else:
        monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    host = (base_url or wandb.Settings().base_url).split("://")[1]
    assert not _wandb_has_credentials()
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert _wandb_has_credentials()
    monkeypatch.delenv("NETRC")
    (tmp_path / ".netrc").write_text(netrc_file.read_text())
    (tmp_path / ".netrc").chmod(0o600)
    assert _wandb_has_credentials()


def test_a_key_without_a_network_logs_offline(tiny_overrides, monkeypatch, capsys):
    """A key on a compute node without internet: wandb.init failed after its timeout and the run
    died after building its model and data. It logs offline instead, under the same run id."""
    import wandb

    real, modes = wandb.init, []

    def init(**kwargs):
        modes.append(kwargs["mode"])
        if kwargs["mode"] == "online":
            raise wandb.errors.CommError("context deadline exceeded")
        return real(**kwargs)

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(wandb, "init", init)
    cfg = load_config(RECIPE, tiny_overrides + ["logging.wandb=true", "train.max_steps=1"])
    assert train(cfg)["step"] == 1
    assert modes == ["online", "offline"]
    assert "wandb: cannot reach the server (context deadline exceeded); logging offline" in \
        capsys.readouterr().err
    assert glob.glob(os.path.join(cfg.run.dir, "wandb", "offline-run-*"))


def test_a_resume_with_an_empty_wandb_id_file_logs_to_a_new_run(tiny_overrides, monkeypatch,
                                                                 capsys):
    """A crash or a full disk while the id file was rewritten left it empty: wandb refused the
    empty id ("Run ID cannot be empty") after the model was built, at every resume. The run now
    notes it and logs to a new wandb run, whose id it records whole."""
    from tandem.trainer.metrics import WANDB_ID_FILE, MetricsLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config(RECIPE, tiny_overrides + ["logging.wandb=true", "logging.progress=false"])
    os.makedirs(cfg.run.dir)
    id_path = os.path.join(cfg.run.dir, WANDB_ID_FILE)
    open(id_path, "w").close()
    logger = MetricsLogger(cfg, True, 0, 1)
    logger.close()
    assert f"note: {id_path} holds no wandb run id ('')" in capsys.readouterr().err
    run_id = open(id_path).read()
    assert len(run_id) == 8 and glob.glob(os.path.join(cfg.run.dir, "wandb", f"*{run_id}"))


def test_resume_drops_lines_of_metrics_that_are_no_records(tmp_path, capsys):
    """A line that is JSON but no object (`5`), a step that is no integer, bytes that are not UTF-8:
    the truncation at resume crashed on each (after the model was built); they are dropped with a
    note, as torn lines are, and the records up to the resumed step kept."""
    from tandem.trainer.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.5}\n5\n{"step": "5"}\n\xff\xfe\n{"step": 2}\n'
                     b'{"step": 3}\n{"step": 4, "lo')
    truncate_metrics(str(path), 2)
    assert path.read_text() == '{"step": 1, "loss": 2.5}\n{"step": 2}\n'
    assert f"note: {path}: dropped 4 line(s)" in capsys.readouterr().err
