"""CSI driver (spec v1.12): node-local loop-file and btrfs volumes."""
