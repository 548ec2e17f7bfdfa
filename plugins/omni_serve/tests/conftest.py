"""Tests of omni serve: the engine loop in-process, then real server processes on loopback ports.

A module that starts a server (its `server` fixture, a serving.ServerProcess) gets `client` (the official openai
client on it) and `http` (an httpx client on it) from here; a module that needs them otherwise defines its own."""

import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving.py, fault_plugin.py


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
