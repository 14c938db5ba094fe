"""The documentation: every code block runs as written, and the reference covers the code."""
