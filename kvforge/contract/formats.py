"""The marks kvforge writes into its outputs, in a module that imports nothing, so any reader (files, manifests,
configs) can recognise a kvforge directory without importing the module that writes it."""

# Marks an ONNX dir as ours (config.json's "format"); an export from another tool lacks it and is refused clearly.
EXPORT_FORMAT = "kvforge-onnx-v1"
# The completion manifest of an ONNX or engine dir (kvforge.contract.manifest writes and verifies it).
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "kvforge-manifest-v1"
# What a manifest may record: llm_export writes "onnx" dirs, llm_build "engine" dirs (kvforge.contract.manifest).
MANIFEST_KINDS = ("onnx", "engine")
