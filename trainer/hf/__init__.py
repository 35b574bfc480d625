"""Hugging Face interop: import (`importer`), export (`exporter`, the `tandem export` CLI in `export`),
the per-family name maps (`families`) and `model.init_from` (`init_from`)."""
