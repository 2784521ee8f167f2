//! Aligned text tables for the command line.

/// A table with a header row; columns are aligned when printed.
#[derive(Debug, Clone, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    right: Vec<bool>,
}

impl Table {
    /// A table with these column names; numeric columns are right-aligned as rows arrive.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        let header: Vec<String> = header.into_iter().map(Into::into).collect();
        let right = vec![true; header.len()];
        Self {
            header,
            rows: Vec::new(),
            right,
        }
    }

    /// Appends a row (missing cells are empty, extra cells are an error in the caller's logic and dropped).
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        let mut cells: Vec<String> = cells.into_iter().map(Into::into).collect();
        cells.resize(self.header.len(), String::new());
        for (i, c) in cells.iter().enumerate() {
            let numeric = c.trim_end_matches(['%', 'x', ' ']).parse::<f64>().is_ok()
                || c.is_empty()
                || c == "-";
            self.right[i] &= numeric;
        }
        self.rows.push(cells);
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether there is no row.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

impl std::fmt::Display for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let width = |i: usize| {
            self.rows
                .iter()
                .map(|r| r[i].chars().count())
                .chain([self.header[i].chars().count()])
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..self.header.len()).map(width).collect();
        let line =
            |f: &mut std::fmt::Formatter<'_>, cells: &[String], header: bool| -> std::fmt::Result {
                let parts: Vec<String> = cells
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        if self.right[i] && !header {
                            format!("{c:>w$}", w = widths[i])
                        } else {
                            format!("{c:<w$}", w = widths[i])
                        }
                    })
                    .collect();
                writeln!(f, "{}", parts.join("  ").trim_end())
            };
        line(f, &self.header, true)?;
        let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
        writeln!(f, "{}", rule.join("  "))?;
        for r in &self.rows {
            line(f, r, false)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_columns() {
        let mut t = Table::new(["name", "ms"]);
        t.row(["a", "1.5"]);
        t.row(["long name", "12.25"]);
        let s = t.to_string();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "name       ms");
        assert_eq!(lines[2], "a            1.5");
        assert_eq!(lines[3], "long name  12.25");
    }
}
