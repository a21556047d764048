-- Every job's row is updated as its run starts and ends, and no update changes an indexed
-- column: with room left on each page the new version goes on the same page (a HOT update),
-- and the primary key is not written again. Full pages sent three updates in four to another
-- page, each with a new index entry (docs/performance.md, "What a row write costs").
-- Pages written from now on keep the room.
ALTER TABLE jobs SET (fillfactor = 70);
