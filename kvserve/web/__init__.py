"""HTTP pieces the server and the router share."""
