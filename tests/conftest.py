"""Gives the whole suite 8 CPU host devices (the sharding tests build meshes from them).

XLA reads the flag when the CPU backend starts, i.e. at the first device use, which comes
after this file is imported. Tests that need one device simply use the default device.
"""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()
