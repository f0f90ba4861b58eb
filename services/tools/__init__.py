"""The tool execution service: built-in tools in-process, python/shell tools in a limited subprocess."""
