"""STAND-IN of ``vllm.utils.argparse_utils``."""

import argparse


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's parser (it also reads ``--config`` files and dashes/underscores alike)."""
