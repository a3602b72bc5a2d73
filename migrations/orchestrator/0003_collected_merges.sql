-- Accepted merges whose objects garbage collection has deleted. An accepted merge can outlive
-- its epoch's collection (an epoch still kept starts from it), so it is collected on its own,
-- once nothing kept starts from it any more.
ALTER TABLE partitions ADD COLUMN collected BOOLEAN NOT NULL DEFAULT false;
CREATE INDEX partitions_accepted_uncollected ON partitions (run_id, epoch)
    WHERE state = 'accepted' AND NOT collected;
