"""Generates mhaclient's gRPC stubs from the repository's proto (standard library only: mhaclient imports it, and
so does the package's build step, setup.py, before grpc or numpy are importable)."""
import os
import subprocess

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def protoc_command(out_dir):
    """The stub generation command (an argv list), to run with the repository root as working directory."""
    return [
        "protoc",
        "-I", "proto",
        "-I", "grpc_health/v1=/usr/share/grpc-proto/grpc/health/v1",
        "--python_out=" + out_dir,
        "--grpc_out=" + out_dir,
        "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
        "proto/mha/v1/attention.proto",
        "grpc_health/v1/health.proto",
    ]


def generate_stubs(out_dir, repo_root=None):
    """Generates mha/v1/attention_pb2*.py and grpc_health/v1/health_pb2*.py under out_dir (created if missing).

    Runs ``protoc_command(out_dir)`` from repo_root (default: two levels above this file). Returns the absolute
    out_dir; add it to sys.path / PYTHONPATH. Raises subprocess.CalledProcessError if protoc fails.
    """
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run(protoc_command(out_dir), cwd=repo_root or _REPO_ROOT, check=True)
    return out_dir
