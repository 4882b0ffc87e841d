"""GPU kernels (Triton): decode-step fusions, the architectures' decode chains, the mailbox pack and host signal;
expert compute in `experts/`."""
