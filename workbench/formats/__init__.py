"""The formats as pure index maps and NumPy references: this package is the spec the kernels are checked against."""
