"""Print the launcher variables this rank received, as JSON (used to compare launchers)."""
import json
import os

NAMES = ("RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
         "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
line = "ENV " + json.dumps({k: v for k, v in os.environ.items()
                           if k in NAMES or k.startswith("TORCHELASTIC_") or k.startswith("TORCH_NCCL")})
# One write() per line: under `python -u` print() writes the text and the newline separately,
# and the lines of ranks sharing one stdout (torchrun) could interleave.
os.write(1, (line + "\n").encode())
