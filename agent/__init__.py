"""libreyolo-agent: trains LibreYOLO on a rented GPU box hands-off, from first boot to teardown."""

__version__ = "0.1.0"
