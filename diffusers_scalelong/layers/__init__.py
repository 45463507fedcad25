"""layers subpackage."""
