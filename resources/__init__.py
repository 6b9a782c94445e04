"""K3 Studio's non-code resources (icon, style sheet, desktop entry).

Installed as the package `k3studio_resources` (pyproject maps this directory to it) so
the app finds them with importlib.resources, in a wheel, an editable install or a
PyInstaller bundle alike -- never by a path relative to the checkout.
"""
