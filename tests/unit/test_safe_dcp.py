"""Checkpoint directories are read without running code from them (trainer/safe_dcp.py): torch's
reader unpickles `.metadata` and its planner torch.loads non-tensor items with weights_only=False,
so a crafted checkpoint passed to model.init_from, eval, export or a resume ran its pickle."""

from __future__ import annotations

import enum
import io
import json
import os
import pathlib
import pickle
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint import metadata as metadata_module

from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig
from tandem.trainer import safe_dcp
from tandem.trainer.checkpoint import save_checkpoint
from tandem.trainer.config import TandemConfig
from tandem.trainer.hf.init_from import load_initial_weights
from tandem.trainer.recipe import to_yaml

CFG = dict(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
           intermediate_size=32, moe_intermediate_size=8, num_experts=2, top_k=1,
           num_shared_experts=0, first_k_dense=1, max_seq_len=32)


class _Marker:
    """Pickles as a call that creates `path`: what a malicious checkpoint would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _checkpoint(tmp_path) -> str:
    cfg = TandemConfig()
    cfg.model, cfg.mtp = ModelConfig(**CFG), MTPConfig(num_steps=1)
    cfg.data.vocab_size = 64
    torch.manual_seed(0)
    model = TandemModel(cfg.model, cfg.mtp)
    return save_checkpoint(str(tmp_path / "run"), 1, model, None, to_yaml(cfg), {})


def test_a_crafted_metadata_is_refused_before_it_runs(tmp_path):
    step = _checkpoint(tmp_path)
    meta = safe_dcp.read_metadata(step)  # a real checkpoint reads
    assert any(k.startswith("model.") for k in meta.state_dict_metadata)
    evil = str(tmp_path / "evil")
    shutil.copytree(step, evil)
    marker = tmp_path / "RAN"
    with open(os.path.join(evil, ".metadata"), "wb") as f:
        pickle.dump(_Marker(str(marker)), f)
    torch.manual_seed(1)
    model = TandemModel(ModelConfig(**CFG), MTPConfig(num_steps=1))
    with pytest.raises(safe_dcp.UnsafeCheckpoint, match=r"evil/\.metadata asks for io\.open"):
        load_initial_weights(model, evil)
    assert not marker.exists()


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as `getattr(EnumClass, "NAME")`, as Python 3.11.2 does."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_metadata_written_by_python_3_11_2_is_read(tmp_path):
    """That Python pickles the tensors' memory-format enum through builtins.getattr, which the
    reader refused: no checkpoint written under Debian 12's Python could be resumed or exported."""
    step = _checkpoint(tmp_path)
    path = os.path.join(step, ".metadata")
    meta = safe_dcp.read_metadata(step)
    with open(path, "wb") as f:
        _EnumsByName(f).dump(meta)
    with open(path, "rb") as f:
        assert b"getattr" in f.read()
    safe_dcp._LAST_METADATA.clear()
    assert safe_dcp.read_metadata(step).state_dict_metadata == meta.state_dict_metadata
    torch.manual_seed(1)
    model = TandemModel(ModelConfig(**CFG), MTPConfig(num_steps=1))
    load_initial_weights(model, step)
    # getattr reaches an enum's member by name, and nothing else
    evil = str(tmp_path / "evil")
    shutil.copytree(step, evil)

    class Home:
        def __reduce__(self):
            return getattr, (pathlib.PosixPath, "home")

    with open(os.path.join(evil, ".metadata"), "wb") as f:
        pickle.dump(Home(), f)
    with pytest.raises(safe_dcp.UnsafeCheckpoint, match=r"asks for getattr\(PosixPath, 'home'\)"):
        safe_dcp.read_metadata(evil)


def test_an_index_a_newer_torch_wrote_names_that_torch(tmp_path, monkeypatch):
    """torch 2.15 pickles TensorProperties with more fields than 2.13 unpacks: a resume under the
    older torch printed only "too many values to unpack (expected 5)"."""
    step = _checkpoint(tmp_path)
    path = os.path.join(step, ".metadata")
    with open(os.path.join(step, "trainer_state.json")) as f:
        assert json.load(f)["torch"] == torch.__version__  # each save records its torch
    meta = safe_dcp.read_metadata(step)
    properties = type(next(md.properties for md in meta.state_dict_metadata.values()
                           if hasattr(md, "properties")))
    getstate = properties.__getstate__
    with monkeypatch.context() as m:
        m.setattr(properties, "__getstate__", lambda self: (*getstate(self), "a newer field"))
        with open(path, "wb") as f:
            pickle.dump(meta, f)
    state = os.path.join(step, "trainer_state.json")
    with open(state) as f:
        recorded = json.load(f)
    with open(state, "w") as f:
        json.dump({**recorded, "torch": "9.1.0"}, f)
    safe_dcp._LAST_METADATA.clear()
    with pytest.raises(ValueError) as info:
        load_initial_weights(TandemModel(ModelConfig(**CFG), MTPConfig(num_steps=1)), step)
    assert str(info.value).startswith(f"checkpoint file {path} cannot be read by torch "
                                      f"{torch.__version__} (ValueError: too many values")
    assert str(info.value).endswith("; it was written by torch 9.1.0: read it with that torch "
                                    "or a newer one")
    # eval and generate read it through the load itself, which wrapped it as "unreadable or
    # corrupt" and cut it at 300 characters
    with pytest.raises(ValueError) as loaded:
        safe_dcp.load({"model": {}}, step, allow_partial_load=True)
    assert str(loaded.value) == str(info.value)
    # an index that this torch's release (another build of it) or an older one wrote is damaged
    for written in (torch.__version__.split("+")[0] + "+cu128", "2.6.0"):
        with open(state, "w") as f:
            json.dump({**recorded, "torch": written}, f)
        with pytest.raises(ValueError, match=f"written by torch {re.escape(written)}, so the file "
                                             "is damaged$"):
            safe_dcp.read_metadata(step)
    os.remove(state)
    with pytest.raises(ValueError, match="; damaged, or written by a newer torch$"):
        safe_dcp.read_metadata(step)


def test_an_index_may_not_set_attributes_of_what_it_shares(tmp_path):
    """BUILD on a class the reader hands out set its attributes for the whole process: an enum's
    member map replaced made later reads of every checkpoint return another member."""
    step = _checkpoint(tmp_path)
    path = os.path.join(step, ".metadata")
    for target in (b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n",
                   b"ctorch\nfloat32\n"):
        with open(path, "wb") as f:  # target.__dict__ / slots updated with {_member_map_: {}}
            f.write(b"\x80\x02" + target + b"N}X\x0c\x00\x00\x00_member_map_}s\x86b.")
        safe_dcp._LAST_METADATA.clear()
        with pytest.raises(safe_dcp.UnsafeCheckpoint, match="asks to set attributes of "):
            safe_dcp.read_metadata(step)
    members = metadata_module._MEM_FORMAT_ENCODING.__members__
    assert "TORCH_CONTIGUOUS_FORMAT" in members


def test_non_tensor_items_load_weights_only(tmp_path):
    """The planner's non-tensor items (the optimizer's param groups) load as plain values; a pickled
    call among them is refused."""
    marker = tmp_path / "RAN"
    planner = safe_dcp.SafeLoadPlanner()
    planner.flatten_state_dict = False
    planner.state_dict = {}

    class Item:
        class dest_index:
            fqn = "x"

    good = io.BytesIO()
    torch.save({"lr": 0.1, "params": [0, 1]}, good)
    good.seek(0)
    planner.load_bytes(Item, good)
    assert planner.state_dict["x"] == {"lr": 0.1, "params": [0, 1]}
    bad = io.BytesIO()
    torch.save(_Marker(str(marker)), bad)
    bad.seek(0)
    with pytest.raises(safe_dcp.UnsafeCheckpoint, match="checkpoint item x: Weights only load"):
        planner.load_bytes(Item, bad)
    assert not marker.exists()


def test_an_unreadable_shard_is_one_line_naming_the_checkpoint(tmp_path):
    """What torch's CheckpointException carries (every rank's traceback) is cut to the first
    rank's cause, for model.init_from and export as for a resume."""
    step = _checkpoint(tmp_path)
    for name in os.listdir(step):
        if name.endswith(".distcp"):
            os.remove(os.path.join(step, name))
    model = TandemModel(ModelConfig(**CFG), MTPConfig(num_steps=1))
    with pytest.raises(ValueError) as info:
        load_initial_weights(model, step)
    message = str(info.value)
    assert message.startswith(f"checkpoint {step} is unreadable or corrupt (FileNotFoundError")
    assert "\n" not in message and "Traceback" not in message


def test_a_checkpoint_read_piece_by_piece_parses_its_index_once(tmp_path, monkeypatch):
    """`tandem export` loads tensor by tensor, and a resume reads the index before its load: each
    read parsed `.metadata` again (45 times for the tiny model's export). A new file at the same
    path (a step saved again) is read anew."""
    step = _checkpoint(tmp_path)
    parses = []
    unpickle = safe_dcp.SafeFileSystemReader._unpickle_metadata
    monkeypatch.setattr(safe_dcp.SafeFileSystemReader, "_unpickle_metadata",
                        lambda self, path: parses.append(path) or unpickle(self, path))
    meta = safe_dcp.read_metadata(step).state_dict_metadata
    names = [k for k, md in meta.items() if k.startswith("model.") and hasattr(md, "size")]
    for key in names:
        t = torch.empty(meta[key].size, dtype=meta[key].properties.dtype)
        safe_dcp.load({"model": {key[len("model."):]: t}}, step, allow_partial_load=True)
    assert len(parses) == 1 and len(names) > 5
    again = str(tmp_path / "again")
    shutil.copytree(step, again)
    shutil.rmtree(step)
    os.rename(again, step)
    safe_dcp.read_metadata(step)
    assert len(parses) == 2
