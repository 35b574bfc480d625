"""Hugging Face interop: import (`importer`), export and the `tandem export` CLI (`export`), the
per-family name maps (`families`) and `model.init_from` (`init_from`)."""
