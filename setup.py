"""Declares the C extension flor._core; everything else is in pyproject.toml.

Build switches (environment variables):
  FLOR_SANITIZE=1  build with AddressSanitizer and UndefinedBehaviorSanitizer
  FLOR_WERROR=1    turn compiler warnings into errors (CI sets it)
"""
import os

from setuptools import Extension, setup

sources = sorted(
    os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".c")
)
headers = sorted(
    os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".h")
)
cflags = ["-std=c11", "-Wall", "-Wextra", "-O2", "-pthread"]
ldflags = ["-pthread"]
if os.environ.get("FLOR_WERROR") == "1":
    cflags.append("-Werror")
options = {}
if os.environ.get("FLOR_SANITIZE") == "1":
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    cflags = [f for f in cflags if f != "-O2"] + ["-O1", "-g"] + san
    ldflags += san
    options = {"build": {"build_base": os.path.join("build", "sanitize")}}

setup(
    options=options,
    ext_modules=[
        Extension(
            "flor._core",
            sources=sources,
            depends=headers,
            extra_compile_args=cflags,
            extra_link_args=ldflags,
        )
    ]
)
