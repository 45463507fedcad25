"""schedulers subpackage."""
