"""Each tier's memory and I/O: GPU slots, pinned-RAM slabs, tmpfs files, disk reads (O_DIRECT, native helpers,
kvikio) and device views of pinned memory."""
