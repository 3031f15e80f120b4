"""Generated from protos/omnistage/worker/v1 by protos/generate.sh; do not edit."""
