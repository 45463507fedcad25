"""edm2 subpackage."""
