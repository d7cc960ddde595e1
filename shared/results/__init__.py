"""Results: the verdict rule, stored references, records for the API and the export, cells, publishing."""
