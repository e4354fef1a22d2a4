"""Model implementations, one architecture per file: crane_mp/models/registry.py lists them (torch-free),
build.py builds one.

Imports nothing, so no model module imports back into here.
"""
