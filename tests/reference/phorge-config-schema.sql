-- SHOW CREATE TABLE of Phorge's config table, read off a real Phorge install
-- (Phorge 07c1a51310, MariaDB 10.11, database phabricator_config) after `bin/storage upgrade`.
-- Not a worker-queue table: the canary keeps its weights and state here
-- (bridge/canary), and the bridge creates it only in SQLite and the tests' databases.

-- config_entry
CREATE TABLE `config_entry` (
  `id` int(10) unsigned NOT NULL AUTO_INCREMENT,
  `phid` varbinary(64) NOT NULL,
  `namespace` varchar(64) NOT NULL,
  `configKey` varchar(64) NOT NULL,
  `value` longtext NOT NULL,
  `isDeleted` tinyint(1) NOT NULL,
  `dateCreated` int(10) unsigned NOT NULL,
  `dateModified` int(10) unsigned NOT NULL,
  PRIMARY KEY (`id`),
  UNIQUE KEY `key_phid` (`phid`),
  UNIQUE KEY `key_name` (`namespace`,`configKey`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
;
