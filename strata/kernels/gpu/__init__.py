"""GPU kernels (Triton): decode-step fusions, slot-indexed expert pairs, grouped GEMMs, the mailbox pack."""
