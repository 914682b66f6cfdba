"""The machine a run uses: devices, precision, threads, ranks and memory."""
