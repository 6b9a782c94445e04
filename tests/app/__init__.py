"""K3 Studio's tests (pytest-qt, offscreen).  A package so that its conftest does not
shadow the engine tests' top-level `conftest` module."""
