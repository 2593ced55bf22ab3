"""Measurement scripts behind the `make bench-*` targets, one folder per topic; not part of the kvforge package.

Run a script as a module from the repository root, e.g. `python -m experiments.reuse.context_reuse --help`: that
puts the root on sys.path, so every script imports the shared helpers as `experiments._common` (and its folder's
`_common`, where one exists). A script never imports another script (tests/test_experiments.py checks it).
"""
