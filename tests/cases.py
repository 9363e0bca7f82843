"""The dtypes and odd shapes every numeric test runs over."""

#: hidden 1, 7, 760, 4096 (odd and power-of-two) x rows 1 and 199
ODD_SHAPES = [(rows, hidden) for rows in (1, 199) for hidden in (1, 7, 760, 4096)]
DTYPES = ["float32", "float16", "bfloat16"]
