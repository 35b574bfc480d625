"""Map every tensor name of an exported Qwen4-Exp checkpoint through vLLM's own drafter loader
remapping (`_remap_mtp_weight_name` of `vllm/models/qwen4_exp/nvidia/mtp.py`, the function
`Qwen4ExpMTP.load_weights` applies) and print one JSON object {"names": {checkpoint name: vLLM
draft-model name or null}, "speculative_config_keys": [the identifier-like string constants of
vLLM's speculative config]}.

Run with the Python of the vLLM virtual environment (never imports tandem):
    python vllm_qwen4_names.py EXPORT_DIR
"""

import json
import os
import struct
import sys


def checkpoint_names(path):
    names = []
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                names += [k for k in json.loads(fh.read(n)) if k != "__metadata__"]
    return names


def vllm_remap():
    """`_remap_mtp_weight_name` as vLLM ships it. Importing its module pulls in vLLM's multimodal
    models (torchvision, which the CPU venv cannot load), so the function's own source is taken from
    the installed file and run alone: it is a pure function of the name."""
    import ast
    import importlib.util

    root = importlib.util.find_spec("vllm").submodule_search_locations[0]
    path = os.path.join(root, "models", "qwen4_exp", "nvidia", "mtp.py")
    tree = ast.parse(open(path).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "_remap_mtp_weight_name")
    namespace = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), namespace)
    return namespace["_remap_mtp_weight_name"]


def speculative_config_keys():
    """The string constants of vLLM's speculative config module (the config.json keys it reads are
    among them)."""
    import ast
    import importlib.util

    root = importlib.util.find_spec("vllm").submodule_search_locations[0]
    tree = ast.parse(open(os.path.join(root, "config", "speculative.py")).read())
    return sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str)
                   and n.value.isidentifier()})


def main(argv):
    _remap_mtp_weight_name = vllm_remap()
    print(json.dumps({"names": {k: _remap_mtp_weight_name(k) for k in checkpoint_names(argv[0])},
                      "speculative_config_keys": speculative_config_keys()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
