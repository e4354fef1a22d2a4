"""Tool calling: the formats models write calls in (formats.py), the grammars that force a call
(forcing.py), and reading calls out of the output, whole or streamed (parser.py over json_scanner.py)."""
