"""Build step of the mhaclient package (metadata in pyproject.toml): the gRPC stubs are generated from the
repository's proto/mha/v1/attention.proto (and the standard health.proto) into the build, as the packages mha.v1 and
grpc_health.v1 that mhaclient imports. Needs the checkout around it: build from client/python in the repository."""
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mhaclient_stubs  # noqa: E402


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        repo_root = os.path.abspath(os.path.join(HERE, "..", ".."))
        if not os.path.isfile(os.path.join(repo_root, "proto", "mha", "v1", "attention.proto")):
            raise RuntimeError("mhaclient builds from a checkout of mhaserve: no proto/ above " + HERE)
        mhaclient_stubs.generate_stubs(self.build_lib, repo_root)
        # Regular packages, so that the wheel lists them (the stubs' own imports are absolute).
        for package in ("mha", "mha/v1", "grpc_health", "grpc_health/v1"):
            open(os.path.join(self.build_lib, package, "__init__.py"), "a").close()


setup(cmdclass={"build_py": BuildPyWithStubs})
