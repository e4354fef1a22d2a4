"""Model implementations, one architecture per file: registry.py lists them (torch-free), build.py builds one.

Imports nothing: the launcher reads registry.py without torch, and no model module imports back into here.
"""
