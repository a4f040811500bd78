"""Weight formats and their kernels: how a weight is stored in memory (float, int8, w8a8,
int4, Q4_K/Q6_K blocks) and the linear layer, embedding and batch-invariant layers that run
it. weight_format.py holds the table of formats."""
