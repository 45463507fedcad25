"""pipelines subpackage."""
