"""omnistage test suites: unit/, worker/, cluster/ (local control plane + localnode), e2e/."""
